// dist/consistency: fingerprints through the store, compared on rank 0 (see consistency.h).
#include "blu/dist/consistency.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "blu/core/error.h"

namespace blu::dist {

namespace {

nlohmann::json to_json(const Fingerprint& f) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& e : f) j.push_back({e.key, e.value, e.must_agree});
  return j;
}

// "rank 0: 4; rank 1: 3" — each distinct value once, with the ranks that had it.
std::string who_had_what(const std::vector<std::map<std::string, std::string>>& ranks, const std::string& key) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < ranks.size(); ++r) {
    auto it = ranks[r].find(key);
    const std::string v = it == ranks[r].end() ? "(missing)" : it->second;
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == v; });
    if (g == groups.end()) {
      groups.push_back({v, {int(r)}});
    } else {
      g->second.push_back(int(r));
    }
  }
  std::string out;
  for (const auto& [v, rs] : groups) {
    if (!out.empty()) out += "; ";
    out += rs.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < rs.size(); ++i) out += (i ? "," : "") + std::to_string(rs[i]);
    out += " had " + v;
  }
  return out;
}

}  // namespace

std::vector<std::string> check_consistency(TcpStore& store, int rank, int world_size, const Fingerprint& mine,
                                           Milliseconds timeout) {
  const std::string prefix = "consistency/";
  if (rank != 0) {
    store.set(prefix + std::to_string(rank), to_json(mine).dump());
    const Milliseconds saved = store.timeout();
    store.set_timeout(timeout);
    std::string verdict;
    try {
      verdict = store.get(prefix + "verdict");
    } catch (const Error& e) {
      store.set_timeout(saved);
      BLU_CHECK(false, "rank ", rank, ": no verdict from rank 0 on whether the ranks were started alike within ",
                timeout.count() / 1000.0, " s (", e.what(), ")");
    }
    store.set_timeout(saved);
    if (!verdict.empty()) store.set(prefix + "read/" + std::to_string(rank), "");  // rank 0 may exit now
    BLU_CHECK(verdict.empty(), verdict);
    return {};
  }
  // Rank 0: every rank's fingerprint, in rank order.
  std::vector<std::map<std::string, std::string>> ranks(static_cast<size_t>(world_size));
  std::vector<std::string> order;
  std::map<std::string, bool> must_agree;
  for (const auto& e : mine) {
    ranks[0][e.key] = e.value;
    order.push_back(e.key);
    must_agree[e.key] = e.must_agree;
  }
  const Milliseconds saved = store.timeout();
  store.set_timeout(timeout);
  std::string error;
  for (int r = 1; r < world_size && error.empty(); ++r) {
    try {
      const nlohmann::json j = nlohmann::json::parse(store.get(prefix + std::to_string(r)));
      for (const auto& e : j) {
        const std::string key = e.at(0).get<std::string>();
        ranks[size_t(r)][key] = e.at(1).get<std::string>();
        if (!must_agree.count(key)) {
          order.push_back(key);
          must_agree[key] = e.at(2).get<bool>();
        }
      }
    } catch (const Error& e) {
      error = "rank " + std::to_string(r) + " did not send its fingerprint within " +
              std::to_string(timeout.count() / 1000.0) + " s (" + e.what() + ")";
    } catch (const std::exception& e) {
      error = "rank " + std::to_string(r) + " sent an unreadable fingerprint: " + e.what();
    }
  }
  store.set_timeout(saved);
  std::vector<std::string> differing, notes;
  if (error.empty()) {
    for (const std::string& key : order) {
      bool same = true;
      for (size_t r = 1; r < ranks.size() && same; ++r) {
        auto a = ranks[0].find(key), b = ranks[r].find(key);
        same = (a == ranks[0].end()) == (b == ranks[r].end()) && (a == ranks[0].end() || a->second == b->second);
      }
      if (same) continue;
      (must_agree[key] ? differing : notes).push_back(key + ": " + who_had_what(ranks, key));
    }
    if (!differing.empty()) {
      error = "the ranks were started with different settings; every rank must get the same options:";
      const size_t shown = std::min<size_t>(differing.size(), 8);
      for (size_t i = 0; i < shown; ++i) error += "\n  " + differing[i];
      if (differing.size() > shown) error += "\n  ... and " + std::to_string(differing.size() - shown) + " more";
    }
  }
  store.set(prefix + "verdict", error);
  if (!error.empty()) {
    // Rank 0 serves the store: it stays until every rank has read the verdict (or a few seconds).
    std::vector<std::string> read;
    for (int r = 1; r < world_size; ++r) read.push_back(prefix + "read/" + std::to_string(r));
    try {
      store.wait(read, std::min(timeout, Milliseconds(5000)));
    } catch (const Error&) {
    }
  }
  BLU_CHECK(error.empty(), error);
  return notes;
}

std::string agree_on(TcpStore& store, int rank, const std::string& name, const std::string& value) {
  const std::string key = "consistency/agree/" + name;
  if (rank == 0) {
    store.set(key, value);
    return value;
  }
  return store.get(key);
}

}  // namespace blu::dist
