// dist/store_protocol: the store server's parsing of hellos and requests, and its key-value table,
// on bytes (the fuzz target fuzz/store_protocol.cpp drives the same functions).
#include <gtest/gtest.h>

#include <cstring>

#include "blu/dist/store_protocol.h"

namespace blu::dist {
namespace {

void put_u32(std::string& b, uint32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); }

std::string request(uint8_t op, const std::string& key, const std::string& value, int64_t arg) {
  std::string r(1, char(op));
  put_u32(r, uint32_t(key.size()));
  r += key;
  put_u32(r, uint32_t(value.size()));
  r += value;
  r.append(reinterpret_cast<const char*>(&arg), 8);
  return r;
}

std::string hello(const std::string& job, uint32_t magic = kStoreMagic, uint32_t version = kStoreVersion) {
  std::string h;
  put_u32(h, magic);
  put_u32(h, version);
  put_u32(h, uint32_t(job.size()));
  return h + job + std::string(kStoreNonceBytes, 'n');
}

TEST(StoreProtocol, EveryPrefixOfARequestIsIncompleteAndTheWholeIsOneMessage) {
  const std::string r = request(kStoreSet, "key", "value", 7);
  for (size_t n = 0; n < r.size(); ++n) {
    StoreRequest out;
    EXPECT_EQ(parse_store_request(std::string_view(r).substr(0, n), 64, 64, out).kind, StoreParse::incomplete) << n;
  }
  StoreRequest out;
  const StoreParse p = parse_store_request(r + "next", 64, 64, out);
  ASSERT_EQ(p.kind, StoreParse::message);
  EXPECT_EQ(p.used, r.size());
  EXPECT_EQ(out.op, kStoreSet);
  EXPECT_EQ(out.key, "key");
  EXPECT_EQ(out.value, "value");
  EXPECT_EQ(out.arg, 7);
}

TEST(StoreProtocol, LengthsOverTheCapsAreRefusedBeforeTheirBytesArrive) {
  StoreRequest out;
  std::string r(1, char(kStoreGet));
  put_u32(r, 1u << 30);  // a 1 GiB key announced, nothing sent
  StoreParse p = parse_store_request(r, 4096, 1u << 20, out);
  EXPECT_EQ(p.kind, StoreParse::refused);
  EXPECT_NE(p.why.find("a key of 1073741824 bytes (at most 4096)"), std::string::npos) << p.why;
  r = std::string(1, char(kStoreSet));
  put_u32(r, 1);
  r += "k";
  put_u32(r, 0xFFFFFFFFu);
  p = parse_store_request(r, 4096, 1u << 20, out);
  EXPECT_EQ(p.kind, StoreParse::refused);
  EXPECT_NE(p.why.find("a value of 4294967295 bytes"), std::string::npos) << p.why;
  EXPECT_EQ(parse_store_request(std::string("\x09\0\0\0\0", 5), 64, 64, out).kind, StoreParse::refused);
  EXPECT_EQ(store_request_max_bytes(64, 64), 1 + 4 + 64 + 4 + 64 + 8u);
}

TEST(StoreProtocol, HelloOfAnotherProtocolIsSilentAndOfAnotherJobRefused) {
  StoreHello out;
  EXPECT_EQ(parse_store_hello("GET / HTTP/1.1\r\n", "j", out).kind, StoreParse::silent);
  EXPECT_EQ(parse_store_hello(hello("j").substr(0, 20), "j", out).kind, StoreParse::incomplete);
  const StoreParse other = parse_store_hello(hello("other"), "j", out);
  EXPECT_EQ(other.kind, StoreParse::refused);
  EXPECT_NE(other.why.find("not job 'other'"), std::string::npos) << other.why;
  EXPECT_EQ(parse_store_hello(hello("j", kStoreMagic, 9), "j", out).kind, StoreParse::refused);
  std::string long_job = hello("j");
  const uint32_t n = 257;
  std::memcpy(long_job.data() + 8, &n, 4);
  EXPECT_EQ(parse_store_hello(long_job, "j", out).kind, StoreParse::refused);
  const StoreParse ok = parse_store_hello(hello("j") + "more", "j", out);
  ASSERT_EQ(ok.kind, StoreParse::message);
  EXPECT_EQ(ok.used, 12 + 1 + kStoreNonceBytes);
  EXPECT_EQ(out.job, "j");
}

TEST(StoreProtocol, TableKeepsItsCapsAndARefusalChangesNothing) {
  StoreTable t(StoreLimits{2, 20});
  auto apply = [&](uint8_t op, const std::string& k, const std::string& v, int64_t arg) {
    StoreRequest r;
    r.op = op;
    r.key = k;
    r.value = v;
    r.arg = arg;
    return t.apply(r);
  };
  EXPECT_EQ(apply(kStoreSet, "a", "12345", 0).kind, StoreTable::Result::reply);
  EXPECT_EQ(apply(kStoreGet, "b", "", 10).kind, StoreTable::Result::wait);
  EXPECT_EQ(apply(kStoreGet, "b", "", -1).kind, StoreTable::Result::refuse);
  EXPECT_EQ(apply(kStoreAdd, "n", "", INT64_MAX).number, INT64_MAX);
  EXPECT_EQ(apply(kStoreAdd, "n", "", 1).kind, StoreTable::Result::refuse);  // would overflow
  EXPECT_EQ(apply(kStoreSet, "c", "", 0).kind, StoreTable::Result::refuse);  // a third key
  EXPECT_EQ(apply(kStoreSet, "a", std::string(20, 'x'), 0).kind, StoreTable::Result::refuse);  // > 20 bytes
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(t.total_bytes(), 1 + 5 + 1 + 8u);
  EXPECT_EQ(*t.find("a"), "12345");
  EXPECT_EQ(apply(kStoreAdd, "a", "", 1).kind, StoreTable::Result::refuse);  // not a counter
  EXPECT_EQ(apply(kStoreDelete, "a", "", 0).status, kStoreOk);
  EXPECT_EQ(apply(kStoreDelete, "a", "", 0).status, kStoreAbsent);
  EXPECT_EQ(t.total_bytes(), 1 + 8u);
}

}  // namespace
}  // namespace blu::dist
