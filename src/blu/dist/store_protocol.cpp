// dist/store_protocol: the store's message parsing and key-value table (see store_protocol.h).
#include "blu/dist/store_protocol.h"

#include <cstring>

namespace blu::dist {

namespace {

// Little-endian reads from bytes the caller has checked are there.
uint32_t get_u32(std::string_view b, size_t at) {
  uint32_t v;
  std::memcpy(&v, b.data() + at, 4);
  return v;
}
int64_t get_i64(std::string_view b, size_t at) {
  int64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

StoreParse refused(std::string why) { return {StoreParse::refused, 0, std::move(why)}; }

StoreTable::Result refuse(std::string why) { return {StoreTable::Result::refuse, kStoreRefused, std::move(why), 0}; }
StoreTable::Result reply(uint8_t status, std::string value = {}, int64_t number = 0) {
  return {StoreTable::Result::reply, status, std::move(value), number};
}

}  // namespace

StoreParse parse_store_hello(std::string_view b, const std::string& job, StoreHello& out) {
  if (b.size() < 4) return {};
  if (get_u32(b, 0) != kStoreMagic) return {StoreParse::silent, 0, {}};  // not this protocol: say nothing
  if (b.size() < 12) return {};
  if (get_u32(b, 4) != kStoreVersion)
    return refused("the store speaks protocol version " + std::to_string(kStoreVersion) + ", the client " +
                   std::to_string(get_u32(b, 4)) + " (ranks from different BluTrain builds?)");
  const uint32_t job_len = get_u32(b, 8);
  if (job_len > kStoreMaxJobBytes) return refused("a job name longer than 256 bytes");
  const size_t total = 12 + size_t(job_len) + kStoreNonceBytes;
  if (b.size() < total) return {};
  out.job = std::string(b.substr(12, job_len));
  if (out.job != job) return refused("this store serves job '" + job + "', not job '" + out.job + "' (BLU_JOB_ID differs)");
  std::memcpy(out.nonce.data(), b.data() + 12 + job_len, kStoreNonceBytes);
  return {StoreParse::message, total, {}};
}

size_t store_request_max_bytes(uint32_t max_key_bytes, uint32_t max_value_bytes) {
  return 1 + 4 + size_t(max_key_bytes) + 4 + size_t(max_value_bytes) + 8;
}

StoreParse parse_store_request(std::string_view b, uint32_t max_key_bytes, uint32_t max_value_bytes,
                               StoreRequest& out) {
  if (b.size() < 5) return {};
  const uint8_t op = uint8_t(b[0]);
  if (op < kStoreSet || op > kStoreWait) return refused("unknown request " + std::to_string(op));
  const uint32_t key_len = get_u32(b, 1);
  if (key_len > max_key_bytes)
    return refused("a key of " + std::to_string(key_len) + " bytes (at most " + std::to_string(max_key_bytes) + ")");
  if (b.size() < 5 + size_t(key_len) + 4) return {};
  const uint32_t value_len = get_u32(b, 5 + size_t(key_len));
  if (value_len > max_value_bytes)
    return refused("a value of " + std::to_string(value_len) + " bytes (at most " + std::to_string(max_value_bytes) +
                   ")");
  const size_t total = 5 + size_t(key_len) + 4 + size_t(value_len) + 8;
  if (b.size() < total) return {};
  out.op = op;
  out.key = std::string(b.substr(5, key_len));
  out.value = std::string(b.substr(9 + size_t(key_len), value_len));
  out.arg = get_i64(b, 9 + size_t(key_len) + value_len);
  return {StoreParse::message, total, {}};
}

const std::string* StoreTable::find(const std::string& key) const {
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

StoreTable::Result StoreTable::apply(StoreRequest r) {
  switch (r.op) {
    case kStoreSet: {
      auto it = data_.find(r.key);
      const size_t old = it == data_.end() ? 0 : it->first.size() + it->second.size();
      if (it == data_.end() && data_.size() >= limits_.max_keys)
        return refuse("more than " + std::to_string(limits_.max_keys) + " keys");
      if (total_bytes_ - old + r.key.size() + r.value.size() > limits_.max_total_bytes)
        return refuse("more than " + std::to_string(limits_.max_total_bytes) + " bytes of keys and values");
      total_bytes_ = total_bytes_ - old + r.key.size() + r.value.size();
      data_[std::move(r.key)] = std::move(r.value);
      return reply(kStoreOk);
    }
    case kStoreGet:
    case kStoreWait: {
      if (r.arg < 0) return refuse("a negative timeout (" + std::to_string(r.arg) + " ms)");
      auto it = data_.find(r.key);
      if (it == data_.end()) return {Result::wait, kStoreOk, {}, 0};
      return reply(kStoreOk, r.op == kStoreGet ? it->second : std::string());
    }
    case kStoreAdd: {
      auto it = data_.find(r.key);
      int64_t v = 0;
      if (it != data_.end()) {
        if (it->second.size() != 8) return refuse("add on key '" + r.key + "', which holds no counter");
        std::memcpy(&v, it->second.data(), 8);
      } else if (data_.size() >= limits_.max_keys) {
        return refuse("more than " + std::to_string(limits_.max_keys) + " keys");
      } else if (total_bytes_ + r.key.size() + 8 > limits_.max_total_bytes) {
        return refuse("more than " + std::to_string(limits_.max_total_bytes) + " bytes of keys and values");
      }
      int64_t sum = 0;
      if (__builtin_add_overflow(v, r.arg, &sum))
        return refuse("add of " + std::to_string(r.arg) + " to " + std::to_string(v) + " overflows key '" + r.key + "'");
      if (it == data_.end()) total_bytes_ += r.key.size() + 8;
      data_[r.key] = std::string(reinterpret_cast<const char*>(&sum), 8);
      return reply(kStoreOk, {}, sum);
    }
    case kStoreCheck: return reply(data_.count(r.key) ? kStoreOk : kStoreAbsent);
    case kStoreDelete: {
      auto it = data_.find(r.key);
      if (it == data_.end()) return reply(kStoreAbsent);
      total_bytes_ -= it->first.size() + it->second.size();
      data_.erase(it);
      return reply(kStoreOk);
    }
  }
  return refuse("unknown request " + std::to_string(r.op));
}

}  // namespace blu::dist
