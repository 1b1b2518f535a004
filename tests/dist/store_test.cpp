// dist/tcp_store: set/get/add/wait/check/remove between threads of one process, waiting, timeouts
// and a vanished server; and what an outside or hostile client gets (Note [Store security]):
// nothing without the secret or from another job, no allocation for a bare length prefix, no
// thread or descriptor per connection, saturating timeouts, capped sizes.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include "blu/core/error.h"
#include "blu/dist/launch.h"
#include "blu/dist/tcp_store.h"
#include "common/checks.h"

namespace blu::dist {
namespace {

using blu::test::error_of;

using namespace std::chrono_literals;

TEST(TcpStore, SetGetAddCheckRemove) {
  TcpStore server("127.0.0.1", 0, true, 5000ms);
  TcpStore client("127.0.0.1", server.port(), false, 5000ms);
  server.set("a", std::string("x\0y", 3));
  EXPECT_EQ(client.get("a"), std::string("x\0y", 3));
  client.set("a", "");  // overwrite with empty
  EXPECT_EQ(server.get("a"), "");
  EXPECT_TRUE(client.check({"a"}));
  EXPECT_FALSE(client.check({"a", "b"}));
  EXPECT_TRUE(client.remove("a"));
  EXPECT_FALSE(client.remove("a"));
  EXPECT_FALSE(server.check({"a"}));
  EXPECT_EQ(client.add("n", 5), 5);
  EXPECT_EQ(server.add("n", -2), 3);
}

TEST(TcpStore, GetWaitsForALaterSetAndAddIsAtomic) {
  TcpStore server("127.0.0.1", 0, true, 5000ms);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      TcpStore c("127.0.0.1", server.port(), false, 5000ms);
      for (int i = 0; i < 50; ++i) c.add("count", 1);
      if (t == 3) {
        std::this_thread::sleep_for(100ms);
        c.set("late", "here");
      }
    });
  TcpStore waiter("127.0.0.1", server.port(), false, 5000ms);
  EXPECT_EQ(waiter.get("late"), "here");  // blocks until thread 3 sets it
  for (auto& t : threads) t.join();
  EXPECT_EQ(waiter.add("count", 0), 200);
  waiter.wait({"late", "count"});
}

TEST(TcpStore, TimeoutsNameTheKeyAndTheTimeout) {
  TcpStore server("127.0.0.1", 0, true, 5000ms);
  TcpStore client("127.0.0.1", server.port(), false, 300ms);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { client.get("missing_key"); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(e.find("timed out after 300 ms waiting for key 'missing_key'"), std::string::npos) << e;
  EXPECT_GE(s, 0.25);
  EXPECT_LT(s, 2.0);
  const std::string w = error_of([&] { client.wait({"k1"}, 200ms); });
  EXPECT_NE(w.find("200 ms waiting for key 'k1'"), std::string::npos) << w;
  // The connection still works after a timeout.
  client.set("k1", "v");
  EXPECT_EQ(client.get("k1"), "v");
}

TEST(TcpStore, NoServerAndLostServerAreErrors) {
  const int port = free_port();
  const std::string e = error_of([&] { TcpStore c("127.0.0.1", port, false, 300ms); });
  EXPECT_NE(e.find("could not connect to the store at 127.0.0.1:" + std::to_string(port) + " within 300 ms"),
            std::string::npos)
      << e;
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, true, 5000ms);
  TcpStore client("127.0.0.1", server->port(), false, 10000ms);
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    server.reset();
  });
  const auto t0 = std::chrono::steady_clock::now();
  const std::string lost = error_of([&] { client.get("never"); });
  killer.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
  EXPECT_NE(lost.find("'never'"), std::string::npos) << lost;
}

// Note [Launcher's socket]: a server asked for the port of the socket in BLU_STORE_LISTEN_FD
// serves on that socket (binding the port itself would fail: the socket holds it); a server asked
// for any other port, or for port 0, leaves it alone.
TEST(TcpStore, AdoptsTheLaunchersListeningSocketOnItsPortOnly) {
  const int held = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(held, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(held, 16), 0);
  ASSERT_EQ(::getsockname(held, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  ::setenv(kStoreListenFdEnv, std::to_string(held).c_str(), 1);
  {
    TcpStore other("127.0.0.1", 0, true, 2000ms);
    EXPECT_NE(other.port(), port);
    TcpStore server("127.0.0.1", port, true, 2000ms);
    EXPECT_EQ(server.port(), port);
    TcpStore client("127.0.0.1", port, false, 2000ms);
    client.set("k", "v");
    EXPECT_EQ(server.get("k"), "v");
  }
  EXPECT_EQ(::fcntl(held, F_GETFD), -1);  // the server owned it and closed it
  ::unsetenv(kStoreListenFdEnv);
}

StoreOptions opts(const std::string& secret, const std::string& job = "job-a", int world = 1) {
  StoreOptions o;
  o.secret = secret;
  o.job = job;
  o.world_size = world;
  o.timeout = 2000ms;
  return o;
}

size_t count_entries(const char* dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}
size_t open_fds() { return count_entries("/proc/self/fd"); }
size_t threads() { return count_entries("/proc/self/task"); }

// Resident set size of this process, in bytes.
int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * int64_t(::sysconf(_SC_PAGESIZE));
}

// A raw TCP connection to the store (no handshake): what an outside client can do.
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  return fd;
}

// Reads until the server closes (or 2 s pass); returns what came.
std::string read_until_closed(int fd) {
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string got;
  char buf[4096];
  for (;;) {
    const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k <= 0) break;
    got.append(buf, size_t(k));
  }
  return got;
}

// The handshake of tcp_store.h done by hand on a raw socket; returns whether the store accepted.
bool handshake(int fd, const std::string& secret, const std::string& job) {
  std::string hello;
  const uint32_t magic = 0x53554C42, version = 1, len = uint32_t(job.size());
  hello.append(reinterpret_cast<const char*>(&magic), 4);
  hello.append(reinterpret_cast<const char*>(&version), 4);
  hello.append(reinterpret_cast<const char*>(&len), 4);
  hello += job;
  const std::string mine(32, 'n');
  hello += mine;
  if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != ssize_t(hello.size())) return false;
  char reply[65];
  if (::recv(fd, reply, 65, MSG_WAITALL) != 65 || reply[0] != 0) return false;
  const std::string theirs(reply + 1, 32);
  std::string msg = "blu-store client proof";
  msg.append(reinterpret_cast<const char*>(&len), 4);
  msg += job + theirs + mine;
  unsigned char proof[32];
  unsigned int n = 0;
  HMAC(EVP_sha256(), secret.data(), int(secret.size()), reinterpret_cast<const unsigned char*>(msg.data()),
       msg.size(), proof, &n);
  if (::send(fd, proof, 32, MSG_NOSIGNAL) != 32) return false;
  char ok = 1;
  return ::recv(fd, &ok, 1, MSG_WAITALL) == 1 && ok == 0;
}

template <typename F>
bool eventually(F&& f, std::chrono::milliseconds within = 3000ms) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return f();
}

TEST(TcpStoreSecurity, AClientWithoutTheSecretGetsNothing) {
  TcpStore server("127.0.0.1", 0, true, opts("right secret"));
  server.set("default_pg/rank_0", "10.0.0.1:1234");
  // A client with the wrong secret: refused in the handshake, before any key is served.
  const std::string e = error_of([&] { TcpStore c("127.0.0.1", server.port(), false, opts("wrong secret")); });
  EXPECT_NE(e.find("did not prove that it knows this job's secret"), std::string::npos) << e;
  // An outside client speaking the request format straight away: a GET of the key gets no byte
  // of it; the connection is closed.
  const int fd = raw_connect(server.port());
  std::string req(1, char(2));
  const uint32_t klen = 17, vlen = 0;
  req.append(reinterpret_cast<const char*>(&klen), 4);
  req += "default_pg/rank_0";
  req.append(reinterpret_cast<const char*>(&vlen), 4);
  const int64_t arg = 0;
  req.append(reinterpret_cast<const char*>(&arg), 8);
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  const std::string got = read_until_closed(fd);
  ::close(fd);
  EXPECT_EQ(got.find("10.0.0.1"), std::string::npos);
  EXPECT_TRUE(got.empty()) << got.size() << " bytes came back";
  // The key is untouched and a client with the secret still reads it.
  TcpStore good("127.0.0.1", server.port(), false, opts("right secret"));
  EXPECT_EQ(good.get("default_pg/rank_0"), "10.0.0.1:1234");
}

TEST(TcpStoreSecurity, TwoJobsNeverSeeEachOthersKeys) {
  TcpStore a("127.0.0.1", 0, true, opts("same secret", "job-a"));
  a.set("k", "a's value");
  // Even with the same secret, a client of another job is refused by name.
  const std::string e = error_of([&] { TcpStore b("127.0.0.1", a.port(), false, opts("same secret", "job-b")); });
  EXPECT_NE(e.find("serves job 'job-a', not job 'job-b'"), std::string::npos) << e;
  // A second job's server cannot take the same port.
  const std::string busy = error_of([&] { TcpStore b("127.0.0.1", a.port(), true, opts("other", "job-b")); });
  EXPECT_NE(busy.find("cannot serve on"), std::string::npos) << busy;
}

TEST(TcpStoreSecurity, AnOversizeLengthPrefixAllocatesNothing) {
  TcpStore server("127.0.0.1", 0, true, opts("s"));  // its own client is connection 1
  const int64_t rss0 = rss_bytes();
  // Before the handshake: the 5-byte message of a 2^30-byte key is dropped unanswered.
  {
    const int fd = raw_connect(server.port());
    const char msg[5] = {1, 0, 0, 0, 0x40};
    ASSERT_EQ(::send(fd, msg, 5, MSG_NOSIGNAL), 5);
    EXPECT_TRUE(read_until_closed(fd).empty());
    ::close(fd);
  }
  // After it: the same 5 bytes are refused on the prefix alone.
  {
    const int fd = raw_connect(server.port());
    ASSERT_TRUE(handshake(fd, "s", "job-a"));
    const char msg[5] = {1, 0, 0, 0, 0x40};
    ASSERT_EQ(::send(fd, msg, 5, MSG_NOSIGNAL), 5);
    const std::string why = read_until_closed(fd);
    EXPECT_NE(why.find("a key of 1073741824 bytes (at most 4096)"), std::string::npos) << why;
    ::close(fd);
  }
  EXPECT_LT(rss_bytes() - rss0, int64_t(1) << 20);
  // A value announced just under the cap holds only the bytes that arrived.
  const int fd = raw_connect(server.port());
  ASSERT_TRUE(handshake(fd, "s", "job-a"));
  std::string part(1, char(1));
  const uint32_t klen = 1, vlen = (1u << 20) - 1;
  part.append(reinterpret_cast<const char*>(&klen), 4);
  part += "k";
  part.append(reinterpret_cast<const char*>(&vlen), 4);
  part += "abc";
  ASSERT_EQ(::send(fd, part.data(), part.size(), MSG_NOSIGNAL), ssize_t(part.size()));
  ASSERT_TRUE(eventually([&] { return server.server_stats().connections == 2; }));
  std::this_thread::sleep_for(50ms);
  EXPECT_LT(server.server_stats().buffered_bytes, size_t(256) << 10);
  EXPECT_LT(rss_bytes() - rss0, int64_t(1) << 20);
  ::close(fd);
  // A client's own oversize value is refused before it is sent.
  TcpStore client("127.0.0.1", server.port(), false, opts("s"));
  const std::string big = error_of([&] { client.set("k", std::string((1u << 20) + 1, 'x')); });
  EXPECT_NE(big.find("at most 1048576 allowed"), std::string::npos) << big;
  client.set("still", "works");
  EXPECT_EQ(client.get("still"), "works");
}

TEST(TcpStoreSecurity, KeyValueAndKeyCountCapsAreErrors) {
  StoreOptions o = opts("s");
  o.max_keys = 3;
  TcpStore server("127.0.0.1", 0, true, o);
  TcpStore c1("127.0.0.1", server.port(), false, o);
  c1.set("a", "1");
  c1.set("b", "2");
  c1.add("c", 1);
  c1.set("a", "overwrite is not a new key");
  const std::string e = error_of([&] { c1.set("d", "4"); });
  EXPECT_NE(e.find("more than 3 keys"), std::string::npos) << e;
  TcpStore c2("127.0.0.1", server.port(), false, o);
  const std::string k = error_of([&] { c2.get(std::string(5000, 'k')); });
  EXPECT_NE(k.find("5000 bytes, at most 4096"), std::string::npos) << k;
  c2.set("c", std::string(3, 'x'));
  const std::string counter = error_of([&] { c2.add("c", 1); });
  EXPECT_NE(counter.find("holds no counter"), std::string::npos) << counter;
  TcpStore c3("127.0.0.1", server.port(), false, o);
  c3.remove("c");
  c3.add("c", std::numeric_limits<int64_t>::max());
  const std::string wrap = error_of([&] { c3.add("c", 1); });
  EXPECT_NE(wrap.find("overflows key 'c'"), std::string::npos) << wrap;
}

TEST(TcpStoreSecurity, IdleSocketsMakeNoThreadsAndAreDropped) {
  StoreOptions o = opts("s", "job-a", 2);
  o.handshake_timeout = 300ms;
  TcpStore server("127.0.0.1", 0, true, o);
  const size_t threads0 = threads();
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(raw_connect(server.port()));
  std::this_thread::sleep_for(100ms);
  EXPECT_LE(threads(), threads0);  // one server thread whatever the number of connections
  EXPECT_LE(server.server_stats().connections, 2u + 8u);  // at most world size + 8 open
  // Past the handshake deadline the idle ones are closed, and a rank gets in.
  EXPECT_TRUE(eventually([&] { return server.server_stats().connections == 1; }));  // its own client
  TcpStore rank("127.0.0.1", server.port(), false, o);
  rank.set("k", "v");
  EXPECT_EQ(rank.get("k"), "v");
  for (int fd : idle) ::close(fd);
}

TEST(TcpStoreSecurity, ClosedConnectionsReleaseTheirDescriptors) {
  TcpStore server("127.0.0.1", 0, true, opts("s"));
  {
    TcpStore warm("127.0.0.1", server.port(), false, opts("s"));
  }
  ASSERT_TRUE(eventually([&] { return server.server_stats().connections == 1; }));  // its own client
  const size_t fds0 = open_fds();
  for (int i = 0; i < 300; ++i) ::close(raw_connect(server.port()));
  for (int i = 0; i < 20; ++i) TcpStore c("127.0.0.1", server.port(), false, opts("s"));  // authenticated ones too
  EXPECT_TRUE(eventually([&] { return server.server_stats().connections == 1 && open_fds() == fds0; }))
      << open_fds() << " descriptors open, " << fds0 << " before";
}

TEST(TcpStoreSecurity, AnInt64MaxTimeoutWaitsInsteadOfWrapping) {
  TcpStore server("127.0.0.1", 0, true, opts("s"));
  StoreOptions forever = opts("s");
  TcpStore client("127.0.0.1", server.port(), false, forever);
  client.set_timeout(Milliseconds::max());
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    TcpStore c("127.0.0.1", server.port(), false, opts("s"));
    c.set("late", "v");
    c.set("later", "w");
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(client.get("late"), "v");
  client.wait({"later"}, Milliseconds::max());
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.25);
  setter.join();
  // A negative timeout from a client is refused, not turned into a huge one.
  const std::string neg = error_of([&] { client.wait({"never"}, Milliseconds(-1)); });
  EXPECT_NE(neg.find(">= 0 ms, got -1"), std::string::npos) << neg;
}

TEST(TcpStoreSecurity, StoreBarrierNamesWhatItWaitedFor) {
  TcpStore server("127.0.0.1", 0, true, opts("s", "job-a", 2));
  std::thread other([&] {
    TcpStore c("127.0.0.1", server.port(), false, opts("s", "job-a", 2));
    std::this_thread::sleep_for(200ms);
    store_barrier(c, "b/1", 2, 5000ms, "the test");
  });
  store_barrier(server, "b/1", 2, 5000ms, "the test");
  other.join();
  EXPECT_TRUE(eventually([&] { return server.server_stats().keys == 0; }));  // the barrier cleans up
  const std::string e = error_of([&] { store_barrier(server, "b/2", 2, 200ms, "rank 0's checkpoint at step 7"); });
  EXPECT_NE(e.find("waiting for rank 0's checkpoint at step 7 (1 of 2 ranks had arrived"), std::string::npos) << e;
}

// A request in the raw wire format (tcp_store.h): op, key, value, arg.
std::string raw_request(uint8_t op, const std::string& key, const std::string& value, int64_t arg) {
  std::string r(1, char(op));
  const uint32_t klen = uint32_t(key.size()), vlen = uint32_t(value.size());
  r.append(reinterpret_cast<const char*>(&klen), 4);
  r += key;
  r.append(reinterpret_cast<const char*>(&vlen), 4);
  r += value;
  r.append(reinterpret_cast<const char*>(&arg), 8);
  return r;
}

// One reply's value (status 0 expected), or "<none>" when none comes within `within`.
std::string raw_reply_value(int fd, std::chrono::milliseconds within) {
  timeval tv{time_t(within.count() / 1000), suseconds_t(within.count() % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char head[5];
  if (::recv(fd, head, 5, MSG_WAITALL) != 5 || head[0] != 0) return "<none>";
  uint32_t n = 0;
  std::memcpy(&n, head + 1, 4);
  std::string value(n + 8, '\0');
  if (::recv(fd, value.data(), value.size(), MSG_WAITALL) != ssize_t(value.size())) return "<none>";
  return value.substr(0, n);
}

// Two clients parked on one key; the first has a DELETE of that key buffered behind its GET. When
// the key is set, answering the first runs its DELETE; the second must then see the key as absent
// (and keep waiting for the next set), never the deleted value's freed memory.
TEST(TcpStoreSecurity, AWaiterThatDeletesTheKeyLeavesTheNextWaiterWaiting) {
  TcpStore server("127.0.0.1", 0, true, opts("s"));
  const int a = raw_connect(server.port());
  ASSERT_TRUE(handshake(a, "s", "job-a"));
  const int b = raw_connect(server.port());
  ASSERT_TRUE(handshake(b, "s", "job-a"));
  const std::string a_reqs = raw_request(2, "k", "", 5000) + raw_request(5, "k", "", 0);  // GET k, DELETE k
  ASSERT_EQ(::send(a, a_reqs.data(), a_reqs.size(), MSG_NOSIGNAL), ssize_t(a_reqs.size()));
  std::this_thread::sleep_for(100ms);
  const std::string b_req = raw_request(2, "k", "", 5000);
  ASSERT_EQ(::send(b, b_req.data(), b_req.size(), MSG_NOSIGNAL), ssize_t(b_req.size()));
  std::this_thread::sleep_for(200ms);  // both parked
  server.set("k", std::string(100, 'v'));
  EXPECT_EQ(raw_reply_value(a, 2000ms), std::string(100, 'v'));  // the GET
  EXPECT_EQ(raw_reply_value(a, 2000ms), "");                      // the DELETE (status 0: it existed)
  EXPECT_EQ(raw_reply_value(b, 300ms), "<none>");                 // k is gone: b still waits
  server.set("k", "w");
  EXPECT_EQ(raw_reply_value(b, 2000ms), "w");
  ::close(a);
  ::close(b);
}

}  // namespace
}  // namespace blu::dist
