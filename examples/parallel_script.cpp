// examples/parallel_script: one training script for one device and for any stated layout. Against
// the one-device script (docs/distributed.md, "From one device to a layout") four lines change,
// marked [layout] below: the strategy comes from train::parallelize, a step runs the layout's
// micro-batches, and each micro-batch is cut to this replica's rows.
//   parallel_script [LAYOUT [OUT]]                      one device (no LAYOUT, or "")
//   blutrain launch -n 8 -- parallel_script "replicate(2){ pipeline(2, micro=2){ stage(h.0){ split(2) } stage(h.1){ split(2) } } }" OUT
// Trains gpt2:tiny for 10 steps on a fixed stream of random tokens, 8 rows of 32 a step. Rank 0
// prints each step's loss and, with OUT, writes them there (one per line, 17 digits). Every layout
// trains the one-device losses (tests/dist/layouts_cli_test.cpp: DistLayouts.ScriptRunsEveryLayout).
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>

#include "blu/blu.h"
#include "blu/models/registry.h"
#include "blu/train/layout_setup.h"

using namespace blu;

namespace {

constexpr int64_t kRows = 8, kSeq = 32, kSteps = 10;

// Micro-batch m of `micro` of step `step`'s batch: the same tokens however the batch is cut. The
// tokens are the vocabulary's first 64, so that the loss falls.
std::pair<Tensor, Tensor> batch(int64_t step, int64_t m, int64_t micro) {
  Generator gen(uint64_t(1000 + step));
  const Tensor tokens = randint(0, 64, {kRows, kSeq + 1}, DType::i64, kCPU, &gen);
  const Tensor rows = narrow(tokens, 0, m * (kRows / micro), kRows / micro);
  return {contiguous(narrow(rows, 1, 0, kSeq)), contiguous(narrow(rows, 1, 1, kSeq))};
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string layout = argc > 1 ? argv[1] : "", out = argc > 2 ? argv[2] : "";
  auto model = models::build_model(models::resolve_model_config("gpt2:tiny"), 1);
  const dist::OptimizerConfig oc{.lr = 1e-3};
  train::Parallel par = train::parallelize(*model, layout, kRows, oc);  // [layout]
  std::ofstream losses;
  if (!out.empty() && dist::detect_env().rank == 0) losses.open(out);
  for (int64_t step = 0; step < kSteps; ++step) {
    const dist::StepValues v = par.strategy->step(par.micro_batches(), [&](int64_t m) {  // [layout]
      const auto [x, y] = batch(step, m, par.micro_batches());  // [layout]
      return std::make_pair(narrow(x, 0, par.first_row, par.rows), narrow(y, 0, par.first_row, par.rows));  // [layout]
    }, 1e-3, 1.0);
    const double loss = par.strategy->read(v, false).loss;
    if (dist::detect_env().rank == 0) {
      std::printf("step %lld loss %.6f\n", static_cast<long long>(step), loss);
      char line[32];
      std::snprintf(line, sizeof line, "%.17g\n", loss);
      if (losses) losses << line;
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "parallel_script: %s\n", e.what());
  return 1;
}
