// dist/consistency: before the ranks of a job do anything together, they check that they were
// started alike. Each rank hands in a fingerprint — an ordered list of (key, value) pairs of
// everything that must agree (model config, batch, schedule, strategy, world size, build
// version, parameter shapes, ...); rank 0 collects every rank's through the store, compares them
// with its own and publishes one verdict, so every rank fails at once, with the same message
// naming the keys and which rank had which value, instead of hanging in or corrupting a
// collective. Advisory entries (e.g. the resume step each rank would choose) are compared too but
// only reported: rank 0's choice is what every rank uses (agree_on()).
// Depends on dist/tcp_store, nlohmann/json. Keep: every rank calls check_consistency() and
// agree_on() the same number of times in the same order, before the first collective; the keys
// it uses live under "consistency/" and are not reused.
#pragma once
#include <string>
#include <vector>

#include "blu/dist/tcp_store.h"

namespace blu::dist {

struct FingerprintEntry {
  std::string key, value;
  bool must_agree = true;  // false: a difference is reported in the notes, not an error
};
using Fingerprint = std::vector<FingerprintEntry>;

// Every rank calls it. Returns rank 0's notes on differing advisory entries (empty on other
// ranks); throws blu::Error on every rank when a must_agree entry differs (or a key is missing on
// some rank). Waits up to `timeout` for the other ranks' fingerprints.
std::vector<std::string> check_consistency(TcpStore& store, int rank, int world_size, const Fingerprint& mine,
                                           Milliseconds timeout);

// Rank 0's `value` on every rank (others pass theirs, which is ignored): one decision for all.
std::string agree_on(TcpStore& store, int rank, const std::string& name, const std::string& value);

}  // namespace blu::dist
