// dist/store_protocol: the TCP store's messages and its key-value table as pure functions on bytes
// (tcp_store.h has the wire format): what the server does with what a connection sent, with no
// socket in between, so the parsing can be tested and fuzzed (fuzz/store_protocol.cpp) on its own.
//   parse_store_hello / parse_store_request: read one message from the front of a connection's
//     buffered bytes — incomplete (wait for more), a message (and how many bytes it took), refused
//     (the reason the server sends back), or silent (not this protocol: close without a word);
//   StoreTable: the keys and values with their caps; apply() answers one request, or says that a
//     GET/WAIT must wait for its key, or refuses it.
// Depends on the standard library only. Keep: every length and number from the bytes is checked
// against its cap before it is used, nothing is allocated for a length before its bytes are
// there, and a refused request leaves the table as it was.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace blu::dist {

enum StoreOp : uint8_t { kStoreSet = 1, kStoreGet = 2, kStoreAdd = 3, kStoreCheck = 4, kStoreDelete = 5, kStoreWait = 6 };
enum StoreStatus : uint8_t { kStoreOk = 0, kStoreAbsent = 1, kStoreRefused = 2 };
inline constexpr uint32_t kStoreMagic = 0x53554C42;  // "BLUS" little-endian
inline constexpr uint32_t kStoreVersion = 1;
inline constexpr size_t kStoreNonceBytes = 32, kStoreProofBytes = 32, kStoreMaxJobBytes = 256;
inline constexpr size_t kStoreMaxHelloBytes = 4 + 4 + 4 + kStoreMaxJobBytes + kStoreNonceBytes;

struct StoreParse {
  enum Kind { incomplete, message, refused, silent } kind = incomplete;
  size_t used = 0;  // message: the bytes it took from the front
  std::string why;  // refused: what the client is told
};

struct StoreHello {
  std::string job;
  std::array<uint8_t, kStoreNonceBytes> nonce{};
};
// The client's hello; refused when the version or the job differs from ours (`job`).
StoreParse parse_store_hello(std::string_view in, const std::string& job, StoreHello& out);

struct StoreRequest {
  uint8_t op = 0;
  std::string key, value;
  int64_t arg = 0;  // GET/WAIT: timeout in ms; ADD: delta
};
// The most bytes one request may take under these caps (op, key, value, arg with their lengths).
size_t store_request_max_bytes(uint32_t max_key_bytes, uint32_t max_value_bytes);
StoreParse parse_store_request(std::string_view in, uint32_t max_key_bytes, uint32_t max_value_bytes,
                               StoreRequest& out);

struct StoreLimits {
  size_t max_keys = 1u << 16;
  size_t max_total_bytes = size_t(64) << 20;  // keys and values together
};

class StoreTable {
 public:
  explicit StoreTable(StoreLimits limits) : limits_(limits) {}

  struct Result {
    enum Kind { reply, wait, refuse } kind = reply;
    uint8_t status = kStoreOk;  // reply
    std::string value;          // reply: the value (GET); refuse: the reason
    int64_t number = 0;         // reply: ADD's new value
  };
  // Answers `r` (a parsed request). `wait`: a GET/WAIT whose key is absent; the caller parks it
  // until set() or add() makes the key exist, or until its deadline.
  Result apply(StoreRequest r);
  const std::string* find(const std::string& key) const;
  size_t size() const { return data_.size(); }
  size_t total_bytes() const { return total_bytes_; }

 private:
  StoreLimits limits_;
  std::map<std::string, std::string> data_;
  size_t total_bytes_ = 0;
};

}  // namespace blu::dist
