#include "blu/train/tb_events.h"

#include <array>
#include <chrono>
#include <cstring>
#include <map>

#include "blu/core/error.h"
#include "blu/io/json_file.h"

namespace blu::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protobuf wire format: a field's key is (number << 3 | wire type).
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += char(uint8_t(v) | 0x80);
    v >>= 7;
  }
  out += char(uint8_t(v));
}
void put_key(std::string& out, uint32_t field, Wire wire) { put_varint(out, (uint64_t(field) << 3) | wire); }
template <typename T>
void put_le(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86 and aarch64 are little-endian, as the format is
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kBytes);
  put_varint(out, bytes.size());
  out += bytes;
}

// tensorflow.Event field numbers.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
// tensorflow.Summary: repeated Value value = 1; Summary.Value: tag = 1, simple_value = 2.
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimple = 2;

std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_key(e, kEventWallTime, kFixed64);
  put_le(e, wall_time);
  if (step != 0) {  // proto3 leaves default values out
    put_key(e, kEventStep, kVarint);
    put_varint(e, uint64_t(step));
  }
  return e;
}

std::string folder_name(const std::string& run_name) {
  std::string s = run_name;
  for (char& c : s)
    if (c == '/' || c == '\\' || c == ':') c = '_';
  while (!s.empty() && s.front() == '.') s.erase(s.begin());
  return s.empty() ? "run" : s;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& payload) {
  std::string rec;
  std::string len;
  put_le(len, uint64_t(payload.size()));
  rec += len;
  put_le(rec, masked_crc32c(len.data(), len.size()));
  rec += payload;
  put_le(rec, masked_crc32c(payload.data(), payload.size()));
  return rec;
}

std::string tb_scalar_event(double wall_time, int64_t step, const std::vector<TbScalar>& scalars) {
  std::string summary;
  for (const TbScalar& s : scalars) {
    std::string value;
    put_bytes(value, kValueTag, s.tag);
    put_key(value, kValueSimple, kFixed32);
    put_le(value, s.value);
    put_bytes(summary, kSummaryValue, value);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, kEventSummary, summary);
  return e;
}

std::string tb_file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, kEventFileVersion, "brain.Event:2");
  return e;
}

std::string tb_event_file(const RunData& run) {
  // Seconds since the run's start at each logged step: a step event's "ms" is the mean step time
  // since the previous logged step.
  std::map<int64_t, double> elapsed;
  double t = 0;
  int64_t prev = -1;
  for (const json& e : run.events) {
    if (e["event"] != "step" || !e.contains("step") || !e["step"].is_number_integer()) continue;
    const int64_t step = e["step"].get<int64_t>();
    const double ms = e.contains("ms") && e["ms"].is_number() ? e["ms"].get<double>() : 0;
    if (prev >= 0 && step > prev) t += double(step - prev) * ms / 1e3;
    if (prev < 0) t = double(step) * ms / 1e3;
    elapsed[step] = t;
    prev = step;
  }
  double start = 0;
  std::error_code ec;
  const auto mtime = fs::last_write_time(run.dir / "metrics.jsonl", ec);
  if (!ec) {
    const auto sys = std::chrono::file_clock::to_sys(mtime);
    start = std::chrono::duration<double>(sys.time_since_epoch()).count() - t;
  }
  const auto wall_at = [&](int64_t step) {
    auto it = elapsed.upper_bound(step);  // the last logged step at or before `step`
    return start + (it == elapsed.begin() ? 0.0 : std::prev(it)->second);
  };

  std::map<int64_t, std::vector<TbScalar>> by_step;
  for (const json& plot : report_plots({run})) {
    for (const json& s : plot["series"]) {
      std::string tag = plot["id"].get<std::string>();
      if (!s["part"].get<std::string>().empty()) tag += "/" + s["part"].get<std::string>();
      for (size_t i = 0; i < s["x"].size(); ++i)
        by_step[s["x"][i].get<int64_t>()].push_back({tag, s["y"][i].get<float>()});
    }
  }
  std::string file = tfrecord(tb_file_version_event(start));
  for (const auto& [step, scalars] : by_step) file += tfrecord(tb_scalar_event(wall_at(step), step, scalars));
  return file;
}

std::vector<fs::path> write_tensorboard(const std::vector<RunData>& runs, const fs::path& out) {
  std::vector<fs::path> written;
  for (const RunData& r : runs) {
    const fs::path dir = out / folder_name(r.name);
    fs::create_directories(dir);
    const fs::path file = dir / "events.out.tfevents.blutrain";
    io::write_file_atomic(file, tb_event_file(r));
    written.push_back(file);
  }
  return written;
}

}  // namespace blu::train
