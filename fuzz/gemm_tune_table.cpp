// Fuzz target: the GEMM tuning table file (backend/gemm_tune_table): the header, then key, eight
// hex words of cuBLASLt's algorithm and a time per line. The file is a cache: a line that does not
// parse is skipped with a warning, never an error, and a table read back from what it writes has
// the same keys and algorithms.
#include <cstdlib>
#include <string>
#include <vector>

#include "blu/backend/gemm_tune_table.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  std::vector<std::string> warnings;
  blu::GemmTuneTable table;
  try {
    table = blu::parse_gemm_tune_table(blu::fuzz::as_text(data, size), "<fuzz>.tsv", &warnings);
  } catch (const blu::Error&) {
    std::abort();  // bad lines are warnings
  }
  for (const std::string& w : warnings)
    if (w.rfind("<fuzz>.tsv:", 0) != 0) std::abort();  // each names the file and line
  const std::string text = blu::format_gemm_tune_table(table);
  const blu::GemmTuneTable back = blu::parse_gemm_tune_table(text, "<written back>", &warnings);
  if (back.size() != table.size()) std::abort();
  for (const auto& [key, g] : table) {
    const auto it = back.find(key);
    if (it == back.end() || it->second.algo != g.algo) std::abort();
  }
})
