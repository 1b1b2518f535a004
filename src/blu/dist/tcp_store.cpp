// dist/tcp_store: the store's server (one thread polling every connection, over a map) and its
// client. See tcp_store.h for the protocol.
//
// Note [Store security]
// Who can reach the store: anyone who can open a TCP connection to MASTER_ADDR:MASTER_PORT. The
// server therefore binds the address MASTER_ADDR names (loopback under `blutrain launch`, so only
// this machine's processes can connect) and serves keys only to a client that proves it knows the
// job's secret: each side sends a 32-byte random nonce and answers the other's with
// HMAC-SHA256(secret, label || job || their nonce || own nonce), the two labels differing so a
// proof can never be reflected back. A client also learns that the server is its job's (a stale
// server of another job on a reused port fails the client's check instead of handing it foreign
// keys). What the secret does not protect: the requests after the handshake travel in the clear
// and unauthenticated, so an attacker who can read and rewrite the packets between ranks (not just
// connect) can still tamper; the threat model is an outside client on the same network, or
// another user's job on the same machine. Before authentication a connection costs the server at
// most one small buffer (the hello is at most 300 bytes) for at most handshake_timeout, and the
// connection cap bounds how many there are; after it, ranks are trusted but still cannot make
// the server allocate more than one request's worth (capped) per connection or keep more keys
// than max_keys.
#include "blu/dist/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <thread>

#include "blu/core/error.h"
#include "blu/dist/env.h"
#include "blu/dist/store_protocol.h"

namespace blu::dist {

namespace {

// The wire's constants (dist/store_protocol.h), by their short names here.
constexpr uint8_t kSet = kStoreSet, kGet = kStoreGet, kAdd = kStoreAdd, kCheck = kStoreCheck, kDelete = kStoreDelete,
                  kWait = kStoreWait;
constexpr uint8_t kOk = kStoreOk, kAbsent = kStoreAbsent, kRefused = kStoreRefused;
constexpr uint32_t kMagic = kStoreMagic, kVersion = kStoreVersion;
constexpr size_t kNonceBytes = kStoreNonceBytes, kProofBytes = kStoreProofBytes, kMaxJobBytes = kStoreMaxJobBytes;
constexpr size_t kMaxHelloBytes = kStoreMaxHelloBytes;
constexpr size_t kRecvChunk = 65536;
using Clock = std::chrono::steady_clock;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

// now + d, saturating at time_point::max() (a client may ask for INT64_MAX ms).
Clock::time_point deadline_after(Milliseconds d) {
  const auto now = Clock::now();
  if (d.count() <= 0) return now;
  const auto room = std::chrono::duration_cast<Milliseconds>(Clock::time_point::max() - now);
  return d >= room ? Clock::time_point::max() : now + d;
}

Milliseconds add_saturating(Milliseconds a, Milliseconds b) {
  int64_t s = 0;
  return __builtin_add_overflow(a.count(), b.count(), &s) ? Milliseconds::max() : Milliseconds(s);
}

int poll_ms_until(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return 1 << 30;
  const auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left + 1, 0, 1 << 30));
}

// Both helpers return false when the peer closed, the socket failed or the deadline passed.
bool send_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

bool recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, poll_ms_until(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

void put_u32(std::string& b, uint32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); }
void put_i64(std::string& b, int64_t v) { b.append(reinterpret_cast<const char*>(&v), 8); }
void put_str(std::string& b, const std::string& s) {
  put_u32(b, uint32_t(s.size()));
  b += s;
}

// A length-prefixed string of at most `cap` bytes (the client's reader: the server it talks to
// has proven the job's secret, but a cap still keeps a confused peer from costing gigabytes).
bool read_str(int fd, std::string& s, uint32_t cap, Clock::time_point deadline) {
  uint32_t n = 0;
  if (!recv_all(fd, &n, 4, deadline) || n > cap) return false;
  s.resize(n);
  return n == 0 || recv_all(fd, s.data(), n, deadline);
}

Nonce random_nonce() {
  Nonce n{};
  size_t got = 0;
  while (got < n.size()) {
    const ssize_t k = ::getrandom(n.data() + got, n.size() - got, 0);
    if (k < 0 && errno == EINTR) continue;
    BLU_CHECK(k > 0, "TcpStore: getrandom() failed: ", std::strerror(errno));
    got += size_t(k);
  }
  return n;
}

// HMAC-SHA256(secret, label || job || first || second).
Proof prove(const std::string& secret, const char* label, const std::string& job, const Nonce& first,
            const Nonce& second) {
  std::string msg = label;
  put_str(msg, job);
  msg.append(reinterpret_cast<const char*>(first.data()), first.size());
  msg.append(reinterpret_cast<const char*>(second.data()), second.size());
  Proof out{};
  unsigned int len = 0;
  const unsigned char* r = ::HMAC(EVP_sha256(), secret.data(), int(secret.size()),
                                  reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(), &len);
  BLU_ASSERT(r != nullptr && len == out.size(), "TcpStore: HMAC-SHA256 failed");
  return out;
}

// Note [Launcher's socket]
// A port found free and released (free_port) can be taken by any other process before rank 0
// binds it: with many jobs on one machine (a test suite running tests side by side), an outgoing
// connection's ephemeral port lands on it now and then and rank 0 fails with "Address already in
// use". So `blutrain launch`, when it picks the port itself, binds and listens on it first and
// hands that socket to rank 0 (inherited across exec; kStoreListenFdEnv names its number). The
// server adopts it only when it is a listening TCP socket on exactly the address and port it was
// asked to serve, never for port 0 (else it binds as usual), once per process, and marks it close-on-exec so that
// nothing rank 0 starts inherits it. Clients that connect before rank 0 is up wait in the socket's
// backlog; their handshake deadline and retry cover a slow start.
int adopt_launcher_socket(const sockaddr_in& want) {
  static std::atomic<bool> adopted{false};
  const char* v = std::getenv(kStoreListenFdEnv);
  if (!v || !*v || adopted.load()) return -1;
  char* end = nullptr;
  const long fd = std::strtol(v, &end, 10);
  if (*end != '\0' || fd < 3 || fd > 1 << 20) return -1;
  int listening = 0;
  socklen_t n = sizeof listening;
  sockaddr_in got{};
  socklen_t len = sizeof got;
  if (::getsockopt(int(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) != 0 || !listening ||
      ::getsockname(int(fd), reinterpret_cast<sockaddr*>(&got), &len) != 0 || got.sin_family != AF_INET ||
      got.sin_addr.s_addr != want.sin_addr.s_addr || want.sin_port == 0 || got.sin_port != want.sin_port)
    return -1;
  if (adopted.exchange(true)) return -1;
  ::fcntl(int(fd), F_SETFD, FD_CLOEXEC);
  return int(fd);
}

// A fresh socket bound to addr and listening; BLU_CHECK naming the address when that fails.
int bind_and_listen(const sockaddr_in& addr, const std::string& host, const char* ip, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  BLU_CHECK(fd >= 0, "TcpStore: socket() failed: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 128) != 0) {
    const int e = errno;
    ::close(fd);
    BLU_CHECK(false, "TcpStore: cannot serve on ", host, " (", ip, ") port ", port, ": ", std::strerror(e),
              e == EADDRNOTAVAIL ? " (MASTER_ADDR must be an address of the machine that runs rank 0)"
                                 : " (is another job using MASTER_PORT?)");
  }
  return fd;
}

constexpr const char* kServerLabel = "blu-store server proof";
constexpr const char* kClientLabel = "blu-store client proof";

}  // namespace

// One thread, one poll() over the listening socket, a wake-up pipe and every connection.
// A connection moves through: hello (waiting for the client's hello) → proof (waiting for its
// proof) → ready (serving requests; a GET/WAIT whose key is absent parks it until the key is set
// or its deadline passes, and its socket is not read meanwhile). Bytes are read only up to the
// end of what the current stage may hold, after checking every length prefix against its cap.
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, int port, const StoreOptions& o)
      : o_(o), table_(StoreLimits{o.max_keys, o.max_total_bytes}) {
    BLU_CHECK(o.world_size >= 1, "TcpStore: world_size must be >= 1, got ", o.world_size);
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
    BLU_CHECK(rc == 0 && res, "TcpStore: cannot resolve the store's host '", host, "': ", ::gai_strerror(rc));
    sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
    ::freeaddrinfo(res);
    addr.sin_port = htons(uint16_t(port));
    char ip[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof ip);
    listen_fd_ = adopt_launcher_socket(addr);  // Note [Launcher's socket]: bound and listening already
    if (listen_fd_ < 0) listen_fd_ = bind_and_listen(addr, host, ip, port);
    socklen_t len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    BLU_CHECK(::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0, "TcpStore: pipe() failed: ", std::strerror(errno));
    thread_ = std::thread([this] { loop(); });
  }

  ~TcpStoreServer() {
    stop_ = true;
    const char b = 1;
    (void)!::write(wake_[1], &b, 1);
    thread_.join();
    for (Conn& c : conns_) ::close(c.fd);
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  int port() const { return port_; }
  TcpStore::ServerStats stats() const {
    std::lock_guard lock(stats_mu_);
    return stats_;
  }

 private:
  enum class Stage { hello, proof, ready };
  struct Conn {
    int fd = -1;
    Stage stage = Stage::hello;
    Clock::time_point handshake_deadline;
    Nonce client_nonce{}, server_nonce{};
    std::string in;  // received, not yet handled
    // A parked GET/WAIT.
    bool waiting = false;
    uint8_t wait_op = 0;
    std::string wait_key;
    Clock::time_point wait_deadline;
    bool closing = false;  // refused: close once the reply is sent (it is sent blocking)
  };

  void loop() {
    while (!stop_) {
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      auto next = Clock::time_point::max();
      for (Conn& c : conns_) {
        fds.push_back({c.fd, short(c.waiting ? 0 : POLLIN), 0});  // POLLHUP/POLLERR still report
        if (c.stage != Stage::ready) next = std::min(next, c.handshake_deadline);
        if (c.waiting) next = std::min(next, c.wait_deadline);
      }
      const int r = ::poll(fds.data(), fds.size(), poll_ms_until(next));
      if (r < 0 && errno != EINTR) break;
      if (stop_) break;
      if (r > 0 && (fds[1].revents & POLLIN)) {
        char buf[64];
        while (::read(wake_[0], buf, sizeof buf) > 0) {
        }
      }
      // Connections first (fds[2..] match conns_ in order), then new ones.
      size_t i = 2;
      for (auto it = conns_.begin(); it != conns_.end(); ++i) {
        Conn& c = *it;
        bool keep = true;
        if (r > 0 && fds[i].revents) keep = on_readable(c, fds[i].revents);
        if (keep) keep = on_time(c);
        if (c.closing) keep = false;
        if (keep) {
          ++it;
        } else {
          ::close(c.fd);  // the descriptor goes with the connection
          it = conns_.erase(it);
        }
      }
      if (r > 0 && (fds[0].revents & POLLIN)) accept_one();
      update_stats();
    }
  }

  void accept_one() {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    {
      std::lock_guard lock(stats_mu_);
      ++stats_.accepted;
    }
    if (conns_.size() >= size_t(o_.world_size) + 8) {  // the cap: world size + 8
      refuse_count();
      ::close(fd);
      return;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Conn c;
    c.fd = fd;
    c.handshake_deadline = deadline_after(o_.handshake_timeout);
    conns_.push_back(std::move(c));
  }

  void refuse_count() {
    std::lock_guard lock(stats_mu_);
    ++stats_.refused;
  }

  // Deadlines: an unfinished handshake is dropped; a parked wait that ran out answers "absent".
  bool on_time(Conn& c) {
    const auto now = Clock::now();
    if (c.stage != Stage::ready && now >= c.handshake_deadline) {
      refuse_count();
      return false;
    }
    if (c.waiting && now >= c.wait_deadline) {
      c.waiting = false;
      if (!reply(c, kAbsent, "", 0)) return false;
      return handle_buffered(c);
    }
    return true;
  }

  // Reads what the current stage may still hold, then handles every complete message.
  bool on_readable(Conn& c, short revents) {
    if (c.waiting) return !(revents & (POLLHUP | POLLERR));  // only a hang-up is news
    const size_t limit = stage_limit(c);
    if (c.in.size() >= limit) return refuse(c, "a message longer than the protocol allows");
    char buf[kRecvChunk];
    const size_t want = std::min(sizeof buf, limit - c.in.size());
    const ssize_t k = ::recv(c.fd, buf, want, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (k <= 0) return false;  // closed by the client, or failed
    c.in.append(buf, size_t(k));
    return handle_buffered(c);
  }

  // The most bytes a connection may have buffered in its stage: one whole message.
  size_t stage_limit(const Conn& c) const {
    switch (c.stage) {
      case Stage::hello: return kMaxHelloBytes;
      case Stage::proof: return kProofBytes;
      case Stage::ready: return store_request_max_bytes(o_.max_key_bytes, o_.max_value_bytes);
    }
    return 0;
  }

  bool handle_buffered(Conn& c) {
    for (;;) {
      if (c.waiting || c.closing) return !c.closing;
      size_t used = 0;
      bool ok = true;
      switch (c.stage) {
        case Stage::hello: ok = on_hello(c, used); break;
        case Stage::proof: ok = on_proof(c, used); break;
        case Stage::ready: ok = on_request(c, used); break;
      }
      if (!ok) return false;
      if (used == 0) return true;  // incomplete: wait for more bytes
      c.in.erase(0, used);
      if (c.in.empty() && c.in.capacity() > kRecvChunk) std::string().swap(c.in);  // a large value's buffer
    }
  }

  // The parsers (dist/store_protocol.h) say how many bytes a whole message took, or why not.
  bool on_hello(Conn& c, size_t& used) {
    StoreHello hello;
    const StoreParse p = parse_store_hello(c.in, o_.job, hello);
    if (p.kind == StoreParse::incomplete) return true;
    if (p.kind == StoreParse::silent) {  // not this protocol: say nothing
      refuse_count();
      return false;
    }
    if (p.kind == StoreParse::refused) return refuse(c, p.why);
    c.client_nonce = hello.nonce;
    c.server_nonce = random_nonce();
    const Proof proof = prove(o_.secret, kServerLabel, o_.job, c.client_nonce, c.server_nonce);
    std::string out(1, char(kOk));
    out.append(reinterpret_cast<const char*>(c.server_nonce.data()), kNonceBytes);
    out.append(reinterpret_cast<const char*>(proof.data()), kProofBytes);
    if (!send_blocking(c, out)) return false;
    c.stage = Stage::proof;
    used = p.used;
    return true;
  }

  bool on_proof(Conn& c, size_t& used) {
    if (c.in.size() < kProofBytes) return true;
    const Proof want = prove(o_.secret, kClientLabel, o_.job, c.server_nonce, c.client_nonce);
    if (CRYPTO_memcmp(want.data(), c.in.data(), kProofBytes) != 0)
      return refuse(c, "the client does not know this job's secret (BLU_STORE_SECRET differs)");
    if (!send_blocking(c, std::string(1, char(kOk)))) return false;
    c.stage = Stage::ready;
    used = kProofBytes;
    return true;
  }

  bool on_request(Conn& c, size_t& used) {
    StoreRequest req;
    const StoreParse p = parse_store_request(c.in, o_.max_key_bytes, o_.max_value_bytes, req);
    if (p.kind == StoreParse::incomplete) return true;
    if (p.kind != StoreParse::message) return refuse(c, p.why);
    used = p.used;
    const uint8_t op = req.op;
    const std::string key = req.key;
    const int64_t arg = req.arg;
    StoreTable::Result r = table_.apply(std::move(req));
    switch (r.kind) {
      case StoreTable::Result::refuse: return refuse(c, r.value);
      case StoreTable::Result::wait:
        c.waiting = true;
        c.wait_op = op;
        c.wait_key = key;
        c.wait_deadline = deadline_after(Milliseconds(arg));
        return true;
      case StoreTable::Result::reply:
        if (!reply(c, r.status, r.value, r.number)) return false;
        if (op == kSet || op == kAdd) wake(key);
        return true;
    }
    return false;
  }

  // Answers every connection parked on `key`.
  void wake(const std::string& key) {
    for (Conn& w : conns_) {
      if (!w.waiting || w.wait_key != key) continue;
      // Looked up for each waiter: the previous one's buffered requests may have changed the key.
      const std::string* value = table_.find(key);
      if (!value) return;
      w.waiting = false;
      // A failed send shows up as a hang-up at the next poll.
      if (reply(w, kOk, w.wait_op == kGet ? *value : std::string(), 0)) handle_buffered(w);
    }
  }

  bool reply(Conn& c, uint8_t status, const std::string& value, int64_t number) {
    std::string out(1, char(status));
    put_str(out, value);
    put_i64(out, number);
    return send_blocking(c, out);
  }

  // Tells the client why (in its stage's format) and drops the connection.
  bool refuse(Conn& c, const std::string& why) {
    refuse_count();
    std::string out(1, char(kRefused));
    put_str(out, "refused by the store: " + why);
    if (c.stage == Stage::ready) put_i64(out, 0);
    send_blocking(c, out);
    c.closing = true;
    return false;
  }

  // Replies are small; a client that does not read them within a second is dropped.
  bool send_blocking(Conn& c, const std::string& out) {
    const char* p = out.data();
    size_t n = out.size();
    const auto deadline = deadline_after(Milliseconds(1000));
    while (n > 0) {
      const ssize_t k = ::send(c.fd, p, n, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd pfd{c.fd, POLLOUT, 0};
        if (::poll(&pfd, 1, poll_ms_until(deadline)) <= 0) return false;
        continue;
      }
      if (k <= 0) return false;
      p += k;
      n -= size_t(k);
    }
    return true;
  }

  void update_stats() {
    size_t buffered = 0;
    for (const Conn& c : conns_) buffered += c.in.capacity();
    std::lock_guard lock(stats_mu_);
    stats_.connections = conns_.size();
    stats_.buffered_bytes = buffered;
    stats_.keys = table_.size();
  }

  const StoreOptions o_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  // The loop thread's alone.
  std::list<Conn> conns_;
  StoreTable table_;
  mutable std::mutex stats_mu_;
  TcpStore::ServerStats stats_;
};

std::string generate_store_secret() {
  const Nonce n = random_nonce();
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (uint8_t b : n) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

StoreOptions StoreOptions::from_env(Milliseconds timeout) {
  StoreOptions o;
  o.timeout = timeout;
  const DistEnv env = detect_env();
  o.world_size = env.world_size;
  if (const char* job = std::getenv("BLU_JOB_ID"); job && *job) o.job = job;
  if (const char* secret = std::getenv("BLU_STORE_SECRET"); secret && *secret) {
    o.secret = secret;
  } else {
    BLU_CHECK(env.world_size == 1, "BLU_STORE_SECRET is not set in a job of ", env.world_size,
              " ranks: the store serves only clients that know the job's secret. `blutrain launch` sets it; under ",
              env.source, " export the same value on every rank (e.g. BLU_STORE_SECRET=$(openssl rand -hex 32))");
    static const std::string process_secret = generate_store_secret();  // only this process knows it
    o.secret = process_secret;
  }
  return o;
}

TcpStore::TcpStore(const std::string& host, int port, bool is_server, Milliseconds timeout)
    : TcpStore(host, port, is_server, StoreOptions::from_env(timeout)) {}

TcpStore::TcpStore(const std::string& host, int port, bool is_server, StoreOptions options)
    : options_(std::move(options)), host_(host), port_(port), timeout_(options_.timeout) {
  BLU_CHECK(port >= 0 && port <= 65535, "TcpStore: port must be in [0, 65535], got ", port);
  BLU_CHECK(is_server || port > 0, "TcpStore: a client needs the server's port, got 0");
  BLU_CHECK(!options_.secret.empty(), "TcpStore: expected the job's secret (BLU_STORE_SECRET), got an empty one");
  BLU_CHECK(options_.job.size() <= kMaxJobBytes, "TcpStore: the job name (BLU_JOB_ID) must be at most ",
            kMaxJobBytes, " bytes, got ", options_.job.size());
  BLU_CHECK(timeout_.count() >= 0, "TcpStore: timeout must be >= 0 ms, got ", timeout_.count());
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(host, port, options_);
    port_ = server_->port();
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port_).c_str(), &hints, &res);
  BLU_CHECK(rc == 0 && res, "TcpStore: cannot resolve host '", host, "': ", ::gai_strerror(rc));
  const auto deadline = deadline_after(timeout_);
  std::string last_error;
  // Connect and shake hands, retrying while the server is not up yet or has no free connection.
  for (;;) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ >= 0 && ::connect(fd_, res->ai_addr, res->ai_addrlen) == 0) {
      const int one = 1;
      ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      const Nonce mine = random_nonce();
      std::string hello;
      put_u32(hello, kMagic);
      put_u32(hello, kVersion);
      put_str(hello, options_.job);
      hello.append(reinterpret_cast<const char*>(mine.data()), mine.size());
      uint8_t status = 0;
      const auto hs_deadline = std::min(deadline_after(Milliseconds(10000)), std::max(deadline, deadline_after(Milliseconds(1000))));
      if (send_all(fd_, hello.data(), hello.size()) && recv_all(fd_, &status, 1, hs_deadline)) {
        std::string why;
        if (status != kOk) {
          const bool got = read_str(fd_, why, 4096, hs_deadline);
          ::close(fd_);
          fd_ = -1;
          ::freeaddrinfo(res);
          BLU_CHECK(false, "TcpStore: the store at ", host, ":", port_, " ",
                    got ? why : std::string("refused the connection"));
        }
        Nonce theirs{};
        Proof proof{};
        if (recv_all(fd_, theirs.data(), theirs.size(), hs_deadline) &&
            recv_all(fd_, proof.data(), proof.size(), hs_deadline)) {
          const Proof want = prove(options_.secret, kServerLabel, options_.job, mine, theirs);
          if (CRYPTO_memcmp(want.data(), proof.data(), proof.size()) != 0) {
            ::close(fd_);
            fd_ = -1;
            ::freeaddrinfo(res);
            BLU_CHECK(false, "TcpStore: the store at ", host, ":", port_,
                      " did not prove that it knows this job's secret (BLU_STORE_SECRET differs between ranks, or "
                      "another program listens on MASTER_PORT)");
          }
          const Proof answer = prove(options_.secret, kClientLabel, options_.job, theirs, mine);
          if (send_all(fd_, answer.data(), answer.size()) && recv_all(fd_, &status, 1, hs_deadline)) {
            if (status == kOk) break;  // authenticated
            const bool got = read_str(fd_, why, 4096, hs_deadline);
            ::close(fd_);
            fd_ = -1;
            ::freeaddrinfo(res);
            BLU_CHECK(false, "TcpStore: the store at ", host, ":", port_, " ",
                      got ? why : std::string("refused this client's proof"));
          }
        }
      }
      last_error = "the connection closed during the handshake (the store's connections are all taken?)";
    } else {
      last_error = std::strerror(errno);
    }
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the server may not be up yet
  }
  ::freeaddrinfo(res);
  BLU_CHECK(fd_ >= 0, "TcpStore: could not connect to the store at ", host, ":", port_, " within ",
            timeout_.count(), " ms (last error: ", last_error, "); is rank 0 running and MASTER_ADDR/PORT right?");
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

TcpStore::ServerStats TcpStore::server_stats() const { return server_ ? server_->stats() : ServerStats{}; }

void TcpStore::check_sizes(const std::string& key, const std::string& value) const {
  BLU_CHECK(key.size() <= options_.max_key_bytes, "TcpStore: key '", key.substr(0, 64), "...' has ", key.size(),
            " bytes, at most ", options_.max_key_bytes, " allowed");
  BLU_CHECK(value.size() <= options_.max_value_bytes, "TcpStore: the value of key '", key, "' has ", value.size(),
            " bytes, at most ", options_.max_value_bytes, " allowed");
}

TcpStore::Reply TcpStore::call(uint8_t op, const std::string& key, const std::string& value, int64_t arg,
                               Milliseconds io_timeout) {
  check_sizes(key, value);
  std::lock_guard lock(mu_);
  BLU_CHECK(fd_ >= 0, "TcpStore: the connection to ", host_, ":", port_, " was lost earlier");
  std::string req(1, char(op));
  put_str(req, key);
  put_str(req, value);
  put_i64(req, arg);
  Reply r;
  const auto deadline = deadline_after(io_timeout);
  const bool ok = send_all(fd_, req.data(), req.size()) && recv_all(fd_, &r.status, 1, deadline) &&
                  read_str(fd_, r.value, std::max<uint32_t>(options_.max_value_bytes, 4096), deadline) &&
                  recv_all(fd_, &r.number, 8, deadline);
  if (!ok || r.status == kRefused) {
    ::close(fd_);
    fd_ = -1;
    BLU_CHECK(ok, "TcpStore: lost the store at ", host_, ":", port_, " during a request for key '", key,
              "' (no reply within ", io_timeout.count(), " ms; did rank 0 exit?)");
    BLU_CHECK(false, "TcpStore: the store at ", host_, ":", port_, " ", r.value, " (request for key '", key, "')");
  }
  return r;
}

void TcpStore::set(const std::string& key, const std::string& value) { call(kSet, key, value, 0, timeout_); }

std::string TcpStore::get(const std::string& key) {
  Reply r = call(kGet, key, "", timeout_.count(), add_saturating(timeout_, Milliseconds(5000)));
  BLU_CHECK(r.status == 0, "TcpStore: timed out after ", timeout_.count(), " ms waiting for key '", key, "'");
  return std::move(r.value);
}

int64_t TcpStore::add(const std::string& key, int64_t delta) { return call(kAdd, key, "", delta, timeout_).number; }

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  BLU_CHECK(timeout.count() >= 0, "TcpStore: wait timeout must be >= 0 ms, got ", timeout.count());
  const auto deadline = deadline_after(timeout);
  for (const std::string& key : keys) {
    const int64_t left =
        deadline == Clock::time_point::max()
            ? timeout.count()
            : std::max<int64_t>(0, std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count());
    Reply r = call(kWait, key, "", left, add_saturating(Milliseconds(left), Milliseconds(5000)));
    BLU_CHECK(r.status == 0, "TcpStore: timed out after ", timeout.count(), " ms waiting for key '", key, "'");
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  for (const std::string& key : keys)
    if (call(kCheck, key, "", 0, timeout_).status != 0) return false;
  return true;
}

bool TcpStore::remove(const std::string& key) { return call(kDelete, key, "", 0, timeout_).status == 0; }

void store_barrier(TcpStore& store, const std::string& name, int world_size, Milliseconds timeout,
                   const std::string& what) {
  const std::string arrived = name + "/arrived", open = name + "/open", left = name + "/left";
  if (store.add(arrived, 1) == world_size) store.set(open, "");
  try {
    store.wait({open}, timeout);
  } catch (const Error&) {
    const int64_t n = store.add(arrived, 0);
    BLU_CHECK(false, "timed out after ", timeout.count() / 1000.0, " s waiting for ", what, " (", n, " of ",
              world_size, " ranks had arrived at barrier '", name, "')");
  }
  // The last one out removes the barrier's keys. Past the barrier, a store that is gone (rank 0
  // has exited after the job's last barrier) is no error of this one.
  try {
    if (store.add(left, 1) == world_size) {
      store.remove(arrived);
      store.remove(open);
      store.remove(left);
    }
  } catch (const Error&) {
  }
}

}  // namespace blu::dist
