// dist/tcp_store: the store's server (accept thread + one thread per connection over a map guarded
// by a mutex and a condition variable) and its client. See tcp_store.h for the protocol.
#include "blu/dist/tcp_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <thread>

#include "blu/core/error.h"

namespace blu::dist {

namespace {

enum Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kDelete = 5, kWait = 6 };
using Clock = std::chrono::steady_clock;

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
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, int(std::min<long long>(left, 1 << 30)));
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

bool read_str(int fd, std::string& s, Clock::time_point deadline) {
  uint32_t n = 0;
  if (!recv_all(fd, &n, 4, deadline)) return false;
  if (n > (1u << 30)) return false;
  s.resize(n);
  return n == 0 || recv_all(fd, s.data(), n, deadline);
}

constexpr auto kForever = Clock::time_point::max();

}  // namespace

class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    BLU_CHECK(listen_fd_ >= 0, "TcpStore: socket() failed: ", std::strerror(errno));
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(uint16_t(port));
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, 128) != 0) {
      const int e = errno;
      ::close(listen_fd_);
      BLU_CHECK(false, "TcpStore: cannot serve on port ", port, ": ", std::strerror(e),
                " (is another job using MASTER_PORT?)");
    }
    socklen_t len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    accept_thread_ = std::thread([this] { accept_loop(); });
  }

  ~TcpStoreServer() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      for (int fd : conn_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    cv_.notify_all();
    ::shutdown(listen_fd_, SHUT_RDWR);
    accept_thread_.join();
    for (auto& t : conn_threads_) t.join();
    ::close(listen_fd_);
    for (int fd : conn_fds_) ::close(fd);
  }

  int port() const { return port_; }

 private:
  void accept_loop() {
    for (;;) {
      pollfd pfd{listen_fd_, POLLIN, 0};
      const int r = ::poll(&pfd, 1, 100);
      {
        std::lock_guard lock(mu_);
        if (stop_) return;
      }
      if (r <= 0) continue;
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      std::lock_guard lock(mu_);
      if (stop_) {
        ::close(fd);
        return;
      }
      conn_fds_.push_back(fd);
      conn_threads_.emplace_back([this, fd] { serve(fd); });
    }
  }

  // Answers one client's requests until it disconnects or the server stops.
  void serve(int fd) {
    for (;;) {
      uint8_t op = 0;
      std::string key, value;
      int64_t arg = 0;
      if (!recv_all(fd, &op, 1, kForever) || !read_str(fd, key, kForever) || !read_str(fd, value, kForever) ||
          !recv_all(fd, &arg, 8, kForever))
        return;
      uint8_t status = 0;
      std::string out;
      int64_t number = 0;
      {
        std::unique_lock lock(mu_);
        switch (op) {
          case kSet:
            data_[key] = value;
            cv_.notify_all();
            break;
          case kGet:
          case kWait: {
            const auto deadline = Clock::now() + std::chrono::milliseconds(arg);
            const bool found = cv_.wait_until(lock, deadline, [&] { return stop_ || data_.count(key) > 0; });
            if (!found || stop_ || !data_.count(key)) {
              status = 1;
            } else if (op == kGet) {
              out = data_[key];
            }
            break;
          }
          case kAdd: {
            auto it = data_.find(key);
            int64_t v = 0;
            if (it != data_.end() && it->second.size() == 8) std::memcpy(&v, it->second.data(), 8);
            v += arg;
            data_[key] = std::string(reinterpret_cast<const char*>(&v), 8);
            number = v;
            cv_.notify_all();
            break;
          }
          case kCheck: status = data_.count(key) ? 0 : 1; break;
          case kDelete: status = data_.erase(key) ? 0 : 1; break;
          default: return;  // a client that speaks another protocol: drop it
        }
        if (stop_) return;
      }
      std::string reply(1, char(status));
      put_str(reply, out);
      put_i64(reply, number);
      if (!send_all(fd, reply.data(), reply.size())) return;
    }
  }

  int listen_fd_ = -1;
  int port_ = 0;
  std::thread accept_thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<std::string, std::string> data_;
  std::vector<int> conn_fds_;
  std::vector<std::thread> conn_threads_;
};

TcpStore::TcpStore(const std::string& host, int port, bool is_server, Milliseconds timeout)
    : host_(host), port_(port), timeout_(timeout) {
  BLU_CHECK(port >= 0 && port <= 65535, "TcpStore: port must be in [0, 65535], got ", port);
  BLU_CHECK(is_server || port > 0, "TcpStore: a client needs the server's port, got 0");
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(port);
    port_ = server_->port();
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port_).c_str(), &hints, &res);
  BLU_CHECK(rc == 0 && res, "TcpStore: cannot resolve host '", host, "': ", ::gai_strerror(rc));
  const auto deadline = Clock::now() + timeout;
  std::string last_error;
  for (;;) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ >= 0 && ::connect(fd_, res->ai_addr, res->ai_addrlen) == 0) break;
    last_error = std::strerror(errno);
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the server may not be up yet
  }
  ::freeaddrinfo(res);
  BLU_CHECK(fd_ >= 0, "TcpStore: could not connect to the store at ", host, ":", port_, " within ",
            timeout.count(), " ms (last error: ", last_error, "); is rank 0 running and MASTER_ADDR/PORT right?");
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

TcpStore::Reply TcpStore::call(uint8_t op, const std::string& key, const std::string& value, int64_t arg,
                               Milliseconds io_timeout) {
  std::lock_guard lock(mu_);
  BLU_CHECK(fd_ >= 0, "TcpStore: the connection to ", host_, ":", port_, " was lost earlier");
  std::string req(1, char(op));
  put_str(req, key);
  put_str(req, value);
  put_i64(req, arg);
  Reply r;
  const auto deadline = Clock::now() + io_timeout;
  const bool ok = send_all(fd_, req.data(), req.size()) && recv_all(fd_, &r.status, 1, deadline) &&
                  read_str(fd_, r.value, deadline) && recv_all(fd_, &r.number, 8, deadline);
  if (!ok) {
    ::close(fd_);
    fd_ = -1;
    BLU_CHECK(false, "TcpStore: lost the store at ", host_, ":", port_, " during a request for key '", key,
              "' (no reply within ", io_timeout.count(), " ms; did rank 0 exit?)");
  }
  return r;
}

void TcpStore::set(const std::string& key, const std::string& value) { call(kSet, key, value, 0, timeout_); }

std::string TcpStore::get(const std::string& key) {
  Reply r = call(kGet, key, "", timeout_.count(), timeout_ + Milliseconds(5000));
  BLU_CHECK(r.status == 0, "TcpStore: timed out after ", timeout_.count(), " ms waiting for key '", key, "'");
  return std::move(r.value);
}

int64_t TcpStore::add(const std::string& key, int64_t delta) { return call(kAdd, key, "", delta, timeout_).number; }

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (const std::string& key : keys) {
    const auto left = std::max<int64_t>(
        0, std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count());
    Reply r = call(kWait, key, "", left, Milliseconds(left + 5000));
    BLU_CHECK(r.status == 0, "TcpStore: timed out after ", timeout.count(), " ms waiting for key '", key, "'");
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  for (const std::string& key : keys)
    if (call(kCheck, key, "", 0, timeout_).status != 0) return false;
  return true;
}

bool TcpStore::remove(const std::string& key) { return call(kDelete, key, "", 0, timeout_).status == 0; }

}  // namespace blu::dist
