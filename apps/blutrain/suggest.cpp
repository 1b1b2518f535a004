#include "suggest.h"

#include <algorithm>

namespace blu::cli {

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string closest(const std::string& given, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = 0;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(given, c);
    if (best.empty() || d < best_d) best = c, best_d = d;
  }
  if (best.empty()) return "";
  const size_t limit = std::max<size_t>(2, std::max(given.size(), best.size()) / 3);
  return best_d <= limit ? best : "";
}

std::vector<std::string> long_options(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* op : app.get_options())
    for (const std::string& n : op->get_lnames()) out.push_back(n);
  return out;
}

}  // namespace blu::cli
