#include "blu/train/metrics.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <vector>

#include "blu/core/error.h"

namespace blu::train {

namespace {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int digits(int64_t n) {
  int d = 1;
  while (n >= 10) n /= 10, ++d;
  return d;
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  char buf[32];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  } else if (bytes < 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", bytes / 1024.0);
  } else if (bytes < int64_t(1024) * 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.0f MiB", bytes / (1024.0 * 1024.0));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  }
  return buf;
}

std::string format_count(int64_t n) {
  std::string s = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return (n < 0 ? "-" : "") + out;
}

std::string format_duration(double seconds) {
  const auto t = static_cast<long long>(std::max(0.0, seconds) + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", t / 3600, t / 60 % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", t / 60, t % 60);
  return buf;
}

std::string format_progress_line(const StepStats& s) {
  const int w = digits(s.total_steps);
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %*lld/%lld | loss %.4f | lr %.2e | norm %.2f | %.1f ms | %.0f tok/s | mem %s", w,
                static_cast<long long>(s.step), static_cast<long long>(s.total_steps), s.loss, s.lr, s.grad_norm, s.ms,
                s.tokens_per_s, format_bytes(s.mem_bytes).c_str());
  std::string line = buf;
  if (s.mfu > 0) {
    std::snprintf(buf, sizeof buf, " | mfu %.1f%%", 100 * s.mfu);
    line += buf;
  }
  if (s.skipped >= 0) line += " | skipped " + std::to_string(s.skipped);
  if (s.elapsed_s >= 0) {
    line += " | " + format_duration(s.elapsed_s) + " elapsed";
    if (s.eta_s >= 0) line += ", ETA " + format_duration(s.eta_s);
  }
  return line;
}

void print_parameter_table(std::ostream& os, const nn::NamedTensors& params) {
  size_t name_w = 4, shape_w = 5;
  for (const auto& [name, t] : params) {
    name_w = std::max(name_w, name.size());
    shape_w = std::max(shape_w, shape_str(t.shape()).size());
  }
  int64_t total = 0;
  char buf[512];
  std::snprintf(buf, sizeof buf, "%-*s  %-*s  %15s\n", int(name_w), "name", int(shape_w), "shape", "parameters");
  os << buf;
  for (const auto& [name, t] : params) {
    std::snprintf(buf, sizeof buf, "%-*s  %-*s  %15s\n", int(name_w), name.c_str(), int(shape_w),
                  shape_str(t.shape()).c_str(), format_count(t.numel()).c_str());
    os << buf;
    total += t.numel();
  }
  std::snprintf(buf, sizeof buf, "%-*s  %-*s  %15s\n", int(name_w), "total", int(shape_w),
                (std::to_string(params.size()) + " tensors").c_str(), format_count(total).c_str());
  os << buf;
}

MetricsLog::MetricsLog(const std::string& path) : out_(path, std::ios::app), path_(path) {
  BLU_CHECK(out_.is_open(), "cannot open the metrics file ", path, " for writing");
}

void MetricsLog::write(const nlohmann::json& event) {
  if (!out_.is_open()) return;
  // A sample can end inside a multi-byte character (or be any bytes, with a byte tokenizer):
  // invalid UTF-8 is written as U+FFFD rather than failing the run.
  out_ << event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  out_.flush();
  BLU_CHECK(out_.good(), "writing the metrics file ", path_, " failed");
}

void MetricsLog::truncate_after(const std::string& path, int64_t step) {
  namespace fs = std::filesystem;
  if (!fs::exists(path)) return;
  std::vector<std::string> kept;
  {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_object()) continue;
      if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() > step) continue;
      kept.push_back(line);
    }
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& l : kept) out << l << '\n';
    out.flush();
    BLU_CHECK(out.good(), "rewriting the metrics file ", path, " failed");
  }
  fs::rename(tmp, path);
}

}  // namespace blu::train
