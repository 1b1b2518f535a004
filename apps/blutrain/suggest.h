// apps/blutrain/suggest: "did you mean" for a flag or config key the command does not know — the
// known name closest by edit distance, when it is close enough to be a typo.
// Depends on CLI11. Keep: a suggestion is only printed beside the error, never acted on.
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace blu::cli {

// The name in `candidates` closest to `given` (Levenshtein distance), or "" when even the closest
// needs more than max(2, a third of the longer name's letters) edits.
std::string closest(const std::string& given, const std::vector<std::string>& candidates);

// The long option names of `app`, without their dashes ("lr", "batch-size", ...).
std::vector<std::string> long_options(const CLI::App& app);

}  // namespace blu::cli
