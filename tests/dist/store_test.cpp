// dist/tcp_store: set/get/add/wait/check/remove between threads of one process, waiting, timeouts
// and a vanished server.
#include <gtest/gtest.h>

#include <chrono>
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

}  // namespace
}  // namespace blu::dist
