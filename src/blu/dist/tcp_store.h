// dist/tcp_store: a small key-value store over TCP that bootstraps a distributed job (PyTorch's
// TCPStore in spirit). Rank 0 serves it; every rank (rank 0 included) talks to it as a client.
//   set(key, value)        store bytes under key (overwrites)
//   get(key)               the value, waiting until some rank sets it (up to the timeout)
//   add(key, delta)        atomic counter: adds delta to the integer under key (0 when absent),
//                          returns the new value — barriers and rank counting use it
//   wait(keys)             returns once every key exists (up to the timeout)
//   check(keys)            whether every key exists now (no waiting)
//   remove(key)            deletes key; returns whether it existed
// A wait that runs out throws blu::Error naming the key and the timeout; so does a client that
// cannot reach the server within the timeout, or that loses it.
//
// Only the job's own ranks can talk to it (Note [Store security], tcp_store.cpp): the server
// listens on the address the host name resolves to (MASTER_ADDR; loopback under `blutrain
// launch`), and a connection is served only after a handshake that checks the protocol's magic
// and version, the job's name (its namespace: a client of another job is refused, so two jobs
// never see each other's keys) and proof, both ways, that each side knows the job's secret
// (HMAC-SHA256 over fresh nonces; the secret itself never crosses the wire).
// Every number a client sends is checked before it is used: key and value sizes and the number of
// keys are capped (StoreOptions), a payload is read as its bytes arrive (nothing is allocated for
// a length prefix alone), a connection that has not finished the handshake within
// handshake_timeout is closed, at most world_size + 8 connections are open at once (the rest
// are closed on accept), wait timeouts saturate instead of wrapping, counters refuse to overflow.
//
// Wire format (little-endian). Handshake: client hello = magic u32 'BLUS', version u32, job (u32
// length + bytes), client nonce (32 bytes); server = status u8 (0: nonce 32 + proof 32 follow;
// 2: u32 length + message, then close); client proof (32 bytes); server status u8 (0, or 2 +
// message). Then request = op u8, key (u32 length + bytes), value (u32 length + bytes), arg i64
// (GET/WAIT: timeout in ms; ADD: delta); reply = status u8 (0 ok, 1 timed out / absent, 2 refused:
// the value is the reason and the server closes the connection), value (u32 length + bytes), i64
// (ADD: the new value).
// Depends on core/error, dist/env (StoreOptions::from_env), POSIX sockets, OpenSSL's libcrypto
// (HMAC-SHA256), std::thread. Keep: the server is one thread (poll over every connection) that
// its destructor stops and joins; a closed connection's descriptor is closed at once; a client's
// calls are serialised by a mutex, so one TcpStore may be shared by threads.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace blu::dist {

using Milliseconds = std::chrono::milliseconds;
inline constexpr Milliseconds kDefaultStoreTimeout{30000};

struct StoreOptions {
  // Shared by every rank of the job. Empty is refused. `blutrain launch` generates one; other
  // launchers pass the same BLU_STORE_SECRET to every rank (from_env).
  std::string secret;
  std::string job = "blutrain";  // the job's namespace (BLU_JOB_ID); at most 256 bytes
  Milliseconds timeout = kDefaultStoreTimeout;  // connecting, and every get/wait
  // Server only.
  int world_size = 1;                   // at most world_size + 8 connections at once
  Milliseconds handshake_timeout{10000};  // a connection not authenticated by then is closed
  uint32_t max_key_bytes = 4096;
  uint32_t max_value_bytes = 1u << 20;
  size_t max_keys = 1u << 16;
  size_t max_total_bytes = size_t(64) << 20;  // keys and values together

  // The secret from BLU_STORE_SECRET, the job from BLU_JOB_ID, world_size from the launcher's
  // variables (dist/env). Without BLU_STORE_SECRET: a BLU_CHECK error in a job of several ranks,
  // and otherwise a random secret of this process (so in-process stores work and nothing else
  // can talk to them).
  static StoreOptions from_env(Milliseconds timeout = kDefaultStoreTimeout);
};

// A fresh random secret: 32 bytes as 64 hex digits (what `blutrain launch` hands its ranks).
std::string generate_store_secret();

// The variable through which `blutrain launch` hands rank 0 an already listening socket on
// MASTER_PORT (its file descriptor number); the server adopts it instead of binding the port
// (Note [Launcher's socket], tcp_store.cpp).
inline constexpr const char* kStoreListenFdEnv = "BLU_STORE_LISTEN_FD";

class TcpStoreServer;  // tcp_store.cpp

class TcpStore {
 public:
  // Connects to host:port. With is_server, first starts the server on `port` of the address
  // `host` resolves to (port 0: a free port, see port()). Connecting retries until the timeout.
  TcpStore(const std::string& host, int port, bool is_server, StoreOptions options);
  // StoreOptions::from_env(timeout).
  TcpStore(const std::string& host, int port, bool is_server, Milliseconds timeout = kDefaultStoreTimeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key);  // waits up to timeout()
  int64_t add(const std::string& key, int64_t delta);
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, Milliseconds timeout);
  bool check(const std::vector<std::string>& keys);
  bool remove(const std::string& key);

  Milliseconds timeout() const { return timeout_; }
  void set_timeout(Milliseconds t) { timeout_ = t; }
  int port() const { return port_; }  // the server's port (the one picked when 0 was asked)
  const std::string& host() const { return host_; }
  const std::string& job() const { return options_.job; }
  const StoreOptions& options() const { return options_; }  // another client connects with these

  // The server's state (is_server only; zeros otherwise): for tests and diagnostics.
  struct ServerStats {
    size_t connections = 0;     // open, authenticated or not
    size_t buffered_bytes = 0;  // received and not yet handled, over all connections
    size_t keys = 0;
    size_t accepted = 0, refused = 0;  // connections accepted; closed by a check (cap, handshake, limits)
  };
  ServerStats server_stats() const;

 private:
  struct Reply {
    uint8_t status = 0;
    std::string value;
    int64_t number = 0;
  };
  Reply call(uint8_t op, const std::string& key, const std::string& value, int64_t arg, Milliseconds io_timeout);
  void check_sizes(const std::string& key, const std::string& value) const;

  StoreOptions options_;
  std::unique_ptr<TcpStoreServer> server_;
  std::string host_;
  int port_ = 0;
  int fd_ = -1;
  Milliseconds timeout_;
  std::mutex mu_;
};

// Every one of `world_size` ranks calls it with the same `name` (unique per use); returns once
// all have, or throws blu::Error after `timeout` saying what the wait was for (`what`).
void store_barrier(TcpStore& store, const std::string& name, int world_size, Milliseconds timeout,
                   const std::string& what);

}  // namespace blu::dist
