// backend/gemm_tune_table: the file that keeps timed GEMM algorithm choices across processes
// (backend/cuda/gemm_tune.h times them). One line per GEMM plan:
//   <key> TAB <eight 16-digit hex words: cuBLASLt's opaque algorithm> TAB <ms per call>
// after the header line "# blutrain gemm tuning v1". The key names the GPU, the cuBLASLt version
// and everything the plan depends on (shapes, strides, dtypes, transposes, epilogue, alignment),
// and holds no tab. The file is a cache: a line that does not parse is skipped with a warning that
// names the file and line, and the choice is timed again; a file of another format is not read
// (its first line is not the header) and is replaced by the next save.
// Depends on core/error and POSIX (flock). Keep: save never leaves a half-written file (it writes
// a temporary beside it and renames it over), and merges what is on disk first under a lock on
// `<file>.lock`, so two processes that tune at once both keep their lines.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace blu {

struct TunedGemm {
  std::array<uint64_t, 8> algo{};  // cublasLtMatmulAlgo_t's data
  double ms = 0;                   // time per call when it was chosen
};

using GemmTuneTable = std::map<std::string, TunedGemm>;

// Parses a table's text; `where` names it in warnings. Bad lines go to `warnings` (each naming
// where:line and what is wrong) and are skipped.
GemmTuneTable parse_gemm_tune_table(std::string_view text, const std::string& where,
                                    std::vector<std::string>* warnings);
std::string format_gemm_tune_table(const GemmTuneTable& table);

// Reads `path` (missing: empty; unreadable lines: warnings).
GemmTuneTable load_gemm_tune_table(const std::string& path, std::vector<std::string>* warnings);
// Writes `add` into `path`, over what the file holds now (its other lines kept), atomically.
// Creates the directory. BLU_CHECK when it cannot be written.
void save_gemm_tune_table(const std::string& path, const GemmTuneTable& add);

// Where the table lives unless BLU_GEMM_TUNE_FILE says: $XDG_CACHE_HOME/blutrain/gemm_tune.tsv, or
// $HOME/.cache/blutrain/gemm_tune.tsv; "" when neither variable is set.
std::string default_gemm_tune_file();

}  // namespace blu
