// `blutrain info`: what this binary is and what it can run on — version, build, CUDA, devices,
// BLAS, the host heap, allocators, GEMM tuning and its table file; `blutrain info CKPT`: a checkpoint's format,
// step, the layout that wrote it and its global tensors (dist/layout_checkpoint.h), without
// loading a model; `blutrain info --flight DIR`: each rank's flight-recorder dump in a run folder
// (DIR/flight_recorder) or a dump folder, summarised (dist/flight_recorder.h).
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <vector>
#include <string>
#include <thread>

#include "blu/core/error.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/memory/allocator.h"
#include "blu/train/metrics.h"
#include "commands.h"
#include "host_heap.h"
#ifdef BLU_HAVE_CUDA
#include <cuda_runtime.h>

#include "blu/backend/cuda/gemm.h"
#include "blu/backend/gemm_tune_table.h"
#endif

namespace blu::cli {

namespace {

std::string build_type() {
  std::string s;
#ifdef NDEBUG
  s = "release (NDEBUG";
#else
  s = "debug (assertions on";
#endif
#ifdef __OPTIMIZE__
  s += ", optimised";
#else
  s += ", not optimised";
#endif
  return s + ")";
}

// OpenBLAS exports its configuration; other BLAS libraries do not. Looked up at run time so the
// program does not depend on which BLAS the system's alternatives picked.
std::string blas_description() {
  using ConfigFn = char* (*)();
  using ThreadsFn = int (*)();
  auto config = reinterpret_cast<ConfigFn>(::dlsym(RTLD_DEFAULT, "openblas_get_config"));
  auto threads = reinterpret_cast<ThreadsFn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (config) {
    std::string s = config();  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
    if (threads) s += ", " + std::to_string(threads()) + " threads";
    return s;
  }
  if (::dlsym(RTLD_DEFAULT, "cblas_sgemm")) return "a CBLAS library (not OpenBLAS; no version information)";
  return "none loaded (no matmul kernel in this build yet)";
}

std::string checkpoint_path;  // the optional CKPT argument

// One line for the checkpoint, then one per global tensor.
int run_checkpoint_info(const std::string& path) {
  const std::string format = dist::describe_checkpoint_format(path);
  if (format.starts_with("ZeRO")) {  // its moments are flat shards of ZeRO's order, not global tensors
    std::cout << path << ": " << format << " (loads under ZeRO only; its next save is a layout checkpoint)\n";
    return 0;
  }
  const dist::LayoutCheckpoint ck(path);  // verifies it (COMMIT, sizes, checksums) first
  const TrainState& st = ck.train_state();
  std::cout << path << ": " << dist::describe_checkpoint_format(path) << ", step " << st.step << ", written by "
            << (ck.layout().is_null() ? std::string("(not recorded)") : ck.layout().dump()) << "\n";
  for (const std::string& name : ck.tensors().names()) {
    std::string shape = "[";
    for (int64_t d : ck.tensors().global_shape(name)) shape += (shape.size() > 1 ? ", " : "") + std::to_string(d);
    std::cout << "  " << name << "  " << shape << "] " << ck.tensors().dtype(name) << "\n";
  }
  return 0;
}

int run_info() {
  if (!checkpoint_path.empty()) return run_checkpoint_info(checkpoint_path);
  std::cout << "blutrain " << BLU_VERSION << "\n";
  std::cout << "build:      " << build_type() << ", C++ " << __cplusplus << ", compiler " << __VERSION__ << "\n";
#ifdef BLU_HAVE_CUDA
  std::cout << "CUDA:       built (runtime " << CUDART_VERSION << ")\n";
#else
  std::cout << "CUDA:       not built (configure with -DBLU_CUDA=ON on a machine with nvcc)\n";
#endif
  std::cout << "devices:\n";
  std::cout << "  cpu       " << omp_get_max_threads() << " OpenMP threads, " << std::thread::hardware_concurrency()
            << " hardware threads\n";
#ifdef BLU_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  if (n == 0) std::cout << "  cuda      none found\n";
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    std::cout << "  cuda:" << i << "    " << p.name << ", sm_" << p.major << p.minor << ", "
              << train::format_bytes(int64_t(p.totalGlobalMem)) << "\n";
  }
#endif
  std::cout << "BLAS:       " << blas_description() << "\n";
  std::cout << "host heap:  " << host_heap() << "\n";
  const AllocatorStats cpu = allocator_for(kCPU).stats();
  std::cout << "allocators:\n  cpu       64-byte aligned host memory, no caching (now " << train::format_bytes(cpu.current_bytes)
            << " live, " << cpu.allocs << " allocations)\n";
#ifdef BLU_HAVE_CUDA
  try {
    allocator_for(Device(DeviceType::cuda, 0));
    std::cout << "  cuda      caching allocator\n";
  } catch (const std::exception& e) {
    std::cout << "  cuda      unavailable: " << e.what() << "\n";
  }
  // Note [GEMM tuning] (backend/cuda/gemm.h): the setting, and what the table file holds.
  const cuda::GemmTuning tune = cuda::gemm_tuning();
  std::cout << "GEMM tuning: " << (tune.on ? "on" : "off") << " (BLU_GEMM_TUNE, --gemm-tune); table ";
  if (tune.file.empty()) {
    std::cout << "none (BLU_GEMM_TUNE_FILE=none)\n";
  } else {
    std::cout << tune.file << ": ";
    if (!std::filesystem::exists(tune.file)) {
      std::cout << "not written yet\n";
    } else {
      std::vector<std::string> warnings;
      std::cout << load_gemm_tune_table(tune.file, &warnings).size() << " choices"
                << (warnings.empty() ? "" : ", " + std::to_string(warnings.size()) + " lines skipped") << "\n";
    }
  }
#endif
  return 0;
}

// One line per rank_*.json: its last completed operation per group and the oldest not completed.
int run_flight(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path d = fs::is_directory(fs::path(dir) / "flight_recorder") ? fs::path(dir) / "flight_recorder" : fs::path(dir);
  BLU_CHECK(fs::is_directory(d), "--flight: expected a run folder or a flight-recorder folder, got '", dir,
            "' (not a folder)");
  std::vector<std::pair<int, fs::path>> dumps;
  for (const auto& e : fs::directory_iterator(d)) {
    const std::string name = e.path().filename().string();
    int rank = -1;
    if (std::sscanf(name.c_str(), "rank_%d.json", &rank) == 1 && name == "rank_" + std::to_string(rank) + ".json")
      dumps.emplace_back(rank, e.path());
  }
  BLU_CHECK(!dumps.empty(), "--flight: no rank_R.json dumps in ", d.string());
  std::sort(dumps.begin(), dumps.end());
  for (const auto& [rank, path] : dumps) std::cout << "rank " << rank << ": " << dist::summarize_dump(path) << "\n";
  std::cout << "dumps: " << d.string() << "\n";
  return 0;
}

}  // namespace

Command add_info(CLI::App& root) {
  CLI::App* app = root.add_subcommand("info", "Version, build, devices, BLAS and allocators; or a checkpoint's layout and tensors");
  app->add_option("checkpoint", checkpoint_path,
                  "a checkpoint (ckpt_*.safetensors or a ckpt_* directory): print its format, step, writer layout and tensors");
  auto flight = std::make_shared<std::string>();
  app->add_option("--flight", *flight,
                  "Instead: summarise the flight-recorder dumps of a run folder (RUN/flight_recorder/rank_R.json): "
                  "each rank's last completed collective");
  return {app, [flight] { return flight->empty() ? run_info() : run_flight(*flight); }};
}

}  // namespace blu::cli
