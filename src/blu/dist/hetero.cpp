#include "blu/dist/hetero.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "blu/core/error.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::dist {

std::vector<double> probe_step_times(models::CausalLM& model, ProcessGroup& pg, int64_t b, int64_t T, int reps) {
  BLU_CHECK(b >= 1 && T >= 1 && T <= model.max_seq_len() && reps >= 1, "probe_step_times: expected b >= 1, 1 <= T <= ",
            model.max_seq_len(), " and reps >= 1, got b ", b, ", T ", T, ", reps ", reps);
  const Device dev = model.token_embedding().weight.device();
  Generator gen(4321);
  Tensor idx = randint(0, model.vocab_size(), {b, T}, DType::i64, kCPU, &gen);
  if (!dev.is_cpu()) idx = to_device(idx, dev);
  const bool was_training = model.is_training();
  model.train(true);
  std::vector<double> times;
  for (int r = -1; r < reps; ++r) {
    model.zero_grad();
    const auto t0 = std::chrono::steady_clock::now();
    Tensor loss = model.forward(idx, idx).loss;
    loss.backward();
    (void)to_vector(loss);  // waits for the forward; the gradient read below for the backward
    const Tensor g = model.token_embedding().weight.grad();
    if (g.defined()) (void)to_vector(narrow(reshape(g, {g.numel()}), 0, 0, 1));
    if (r >= 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  model.zero_grad();
  model.train(was_training);
  std::sort(times.begin(), times.end());
  return gather_values(pg, times[times.size() / 2], dev);
}

std::vector<double> gather_values(ProcessGroup& pg, double mine, Device dev) {
  // NCCL takes device tensors, Gloo CPU ones.
  const Device gdev = pg.backend() == "nccl" ? dev : kCPU;
  Tensor one = from_vector({mine}, {1}, DType::f64), all = zeros({pg.size()}, DType::f64, gdev);
  if (!gdev.is_cpu()) one = to_device(one, gdev);
  pg.all_gather(all, one)->wait();
  return to_vector(all);
}

std::vector<double> speeds_from_times(const std::vector<double>& seconds) {
  BLU_CHECK(!seconds.empty(), "speeds_from_times: no times");
  std::vector<double> s;
  double total = 0;
  for (double t : seconds) {
    BLU_CHECK(t > 0 && std::isfinite(t), "speeds_from_times: a time of ", t, " s (expected positive)");
    s.push_back(1.0 / t);
    total += 1.0 / t;
  }
  for (double& v : s) v /= total;
  return s;
}

std::vector<int64_t> proportional_split(int64_t total, const std::vector<double>& weights, int64_t min_each) {
  const int64_t n = int64_t(weights.size());
  BLU_CHECK(n >= 1, "proportional_split: no weights");
  BLU_CHECK(min_each >= 0 && total >= min_each * n, "proportional_split: ", total, " units cannot give ", n,
            " parts at least ", min_each, " each");
  double wsum = 0;
  for (double w : weights) {
    BLU_CHECK(w > 0 && std::isfinite(w), "proportional_split: weight ", w, " (expected positive)");
    wsum += w;
  }
  // Every unit by weight (floors first, then the largest remainders), then a part below min_each
  // takes units from the largest part: the parts stay as close to the exact shares as the floor
  // allows (one unit to each first would move 0.8/0.2 of 10 to 7/3).
  std::vector<int64_t> out(size_t(n), 0);
  std::vector<std::pair<double, int64_t>> rem;
  int64_t given = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double exact = double(total) * weights[size_t(i)] / wsum;
    const int64_t fl = int64_t(std::floor(exact));
    out[size_t(i)] = fl;
    given += fl;
    rem.push_back({exact - double(fl), i});
  }
  std::stable_sort(rem.begin(), rem.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int64_t k = 0; k < total - given; ++k) ++out[size_t(rem[size_t(k)].second)];
  for (int64_t& part : out)
    while (part < min_each) {
      int64_t& largest = *std::max_element(out.begin(), out.end());
      --largest;
      ++part;
    }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> balance_stages(int64_t blocks, const std::vector<double>& speeds,
                                                        double block_seconds, double first_seconds,
                                                        double last_seconds, const std::vector<int64_t>& max_blocks) {
  const int64_t S = int64_t(speeds.size());
  BLU_CHECK(S >= 1 && blocks >= S, "balance_stages: ", blocks, " blocks cannot fill ", S, " stages");
  BLU_CHECK(max_blocks.empty() || int64_t(max_blocks.size()) == S, "balance_stages: ", max_blocks.size(),
            " memory limits for ", S, " stages");
  for (double s : speeds) BLU_CHECK(s > 0 && std::isfinite(s), "balance_stages: speed ", s, " (expected positive)");
  auto cost = [&](int64_t s, int64_t n) {  // stage s running n blocks
    if (!max_blocks.empty() && n > max_blocks[size_t(s)]) return std::numeric_limits<double>::infinity();
    double t = double(n) * block_seconds;
    if (s == 0) t += first_seconds;
    if (s == S - 1) t += last_seconds;
    return t / speeds[size_t(s)];
  };
  // best[s][k]: the least possible slowest-stage time with stages 0..s-1 holding the first k blocks.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(S + 1), std::vector<double>(size_t(blocks + 1), inf));
  std::vector<std::vector<int64_t>> take(size_t(S + 1), std::vector<int64_t>(size_t(blocks + 1), 0));
  best[0][0] = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t k = 0; k <= blocks; ++k) {
      if (best[size_t(s)][size_t(k)] == inf) continue;
      for (int64_t n = 1; k + n <= blocks; ++n) {
        const double t = std::max(best[size_t(s)][size_t(k)], cost(s, n));
        if (t < best[size_t(s + 1)][size_t(k + n)]) best[size_t(s + 1)][size_t(k + n)] = t, take[size_t(s + 1)][size_t(k + n)] = n;
      }
    }
  BLU_CHECK(best[size_t(S)][size_t(blocks)] < inf, "balance_stages: ", blocks, " blocks do not fit ", S,
            " stages under their memory limits");
  std::vector<std::pair<int64_t, int64_t>> out(static_cast<size_t>(S));
  int64_t k = blocks;
  for (int64_t s = S; s >= 1; --s) {
    const int64_t n = take[size_t(s)][size_t(k)];
    out[size_t(s - 1)] = {k - n, k - 1};
    k -= n;
  }
  return out;
}

}  // namespace blu::dist
