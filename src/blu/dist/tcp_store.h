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
// Wire format (little-endian): request = op u8, key (u32 length + bytes), value (u32 length +
// bytes), arg i64 (GET/WAIT: timeout in ms; ADD: delta); reply = status u8 (0 ok, 1 timed out /
// absent), value (u32 length + bytes), i64 (ADD: the new value).
// Depends on core/error, POSIX sockets, std::thread. Keep: the server runs one thread per client
// connection plus an accept thread and stops them all in its destructor (no thread outlives the
// store); a client's calls are serialised by a mutex, so one TcpStore may be shared by threads.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace blu::dist {

using Milliseconds = std::chrono::milliseconds;
inline constexpr Milliseconds kDefaultStoreTimeout{30000};

class TcpStoreServer;  // tcp_store.cpp

class TcpStore {
 public:
  // Connects to host:port. With is_server, first starts the server on `port` of every interface
  // (port 0: a free port, see port()). Connecting retries until `timeout`.
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

 private:
  struct Reply {
    uint8_t status = 0;
    std::string value;
    int64_t number = 0;
  };
  Reply call(uint8_t op, const std::string& key, const std::string& value, int64_t arg, Milliseconds io_timeout);

  std::unique_ptr<TcpStoreServer> server_;
  std::string host_;
  int port_ = 0;
  int fd_ = -1;
  Milliseconds timeout_;
  std::mutex mu_;
};

}  // namespace blu::dist
