// The update behind the next forward (Note [Update behind the forward], offload/offload_adamw.h) as
// the CPU test (offload_test.cpp, on the pool cpu:1) and the GPU test (cuda/offload_cuda_test.cpp)
// run it: four steps of two micro-batches of the tiny GPT in bf16 through dist::Strategy, the AdamW
// state offloaded and updated on the host, with and without the overlap.
#pragma once
#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "blu/blu.h"
#include "blu/dist/strategy.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/offload/offload_adamw.h"
#include "blu/train/trainer.h"
#include "common/tiny_gpt.h"

namespace blu::offload {

struct StrategyRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> weights;
  // When each step() returned, and when the worker reached block 1 of each step's update.
  std::vector<std::chrono::steady_clock::time_point> returned, at_block1;
};

// The run on `device` with --offload-state `state`; `hook` (when set, with the overlap) runs on the
// worker before each block of each update (counted from 0).
inline StrategyRun strategy_run(Device device, const std::string& state, bool overlap,
                                const std::function<void(int64_t update, size_t block)>& hook) {
  using Clock = std::chrono::steady_clock;
  models::GPT model(test::tiny_gpt(), 7);
  model.to(device);
  model.train();
  train::apply_precision(model, "bf16");
  dist::StrategyConfig sc;
  sc.offload_state = true;
  sc.offload.update = UpdateOn::cpu;
  sc.offload.masters_on_host = state == "master";
  sc.offload.chunk_elements = 1000;  // several pieces a parameter
  sc.offload.overlap_forward = overlap;
  dist::Strategy strategy(model, nullptr, sc, dist::OptimizerConfig{.lr = 1e-2});
  auto& opt = dynamic_cast<OffloadAdamW&>(strategy.optimizer());
  StrategyRun r;
  int64_t update = -1;  // the worker's count of the updates it ran
  if (hook)
    opt.set_worker_hook([&](size_t block) {
      if (block == 0) ++update;
      if (block == 1) r.at_block1.push_back(Clock::now());
      hook(update, block);
    });
  for (int64_t step = 0; step < 4; ++step) {
    std::vector<double> ids;
    for (int64_t i = 0; i < 2 * 2 * 16; ++i) ids.push_back(double((step * 37 + i * 11) % 101));
    const Tensor all = to_device(from_vector(ids, {4, 16}, DType::i32), device);
    const dist::StepValues v = strategy.step(2, [&](int64_t m) {
      const Tensor x = narrow(all, 0, 2 * m, 2);
      return std::pair<Tensor, Tensor>{x, x};
    }, 1e-2, 1.0);
    r.returned.push_back(Clock::now());
    r.losses.push_back(strategy.read(v, false).loss);
  }
  strategy.finish_update();
  const auto values = strategy.parameter_values();
  for (const auto& [name, w] : model.state_dict()) r.weights.push_back(to_vector(w));
  return r;
}

}  // namespace blu::offload
