#include "blu/dist/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/ddp.h"
#include "blu/memory/allocator.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu::dist {

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Waits for the device by reading one element of `t` on the host.
void settle(const Tensor& t) {
  if (t.defined()) (void)to_vector(narrow(reshape(t, {t.numel()}), 0, 0, 1));
}

struct Probe {
  double seconds = 0;  // forward + backward, the median of reps
  double act_bytes = 0;  // allocator bytes live after forward, beyond those before it
};

// Forward and backward of embed → (blocks) → head on idx, timed `reps` times after one warm-up.
Probe probe(models::CausalLM& model, const Tensor& idx, bool with_blocks, int reps) {
  Allocator& alloc = allocator_for(idx.device());
  const std::vector<Tensor> params = model.parameters();
  std::vector<double> times;
  Probe p;
  for (int r = -1; r < reps; ++r) {
    model.zero_grad();
    settle(params.front());
    const int64_t before = alloc.stats().current_bytes;
    const double t0 = now();
    Tensor x = model.embed(idx);
    if (with_blocks)
      for (size_t i = 0; i < model.num_blocks(); ++i) x = model.block(i, x);
    Tensor loss = model.head(x, idx).loss;  // the ids as targets: any valid targets do
    x = Tensor();
    p.act_bytes = double(alloc.stats().current_bytes - before);
    loss.backward();
    settle(params.front().grad().defined() ? params.front().grad() : loss);
    if (r >= 0) times.push_back(now() - t0);
  }
  model.zero_grad();
  std::sort(times.begin(), times.end());
  p.seconds = times[times.size() / 2];
  return p;
}

// fixed + per_seq · b through (b, t1) and (2b, t2); a negative fixed part (noise) is clamped.
void fit(double b, double t1, double t2, double& fixed, double& per_seq) {
  per_seq = std::max(0.0, (t2 - t1) / b);
  fixed = std::max(0.0, t1 - per_seq * b);
}

double ring(double bytes, int n, const LinkCosts& l) {  // all-reduce of `bytes` over n ranks
  if (n <= 1) return 0;
  return 2.0 * (n - 1) * l.latency_s + 2.0 * (n - 1) / n * bytes / l.bytes_per_s;
}

double half_ring(double bytes, int n, const LinkCosts& l) {  // reduce-scatter or all-gather
  if (n <= 1) return 0;
  return (n - 1) * l.latency_s + double(n - 1) / n * bytes / l.bytes_per_s;
}

}  // namespace

ModelCosts measure_model(models::CausalLM& model, int64_t b, int64_t T, int reps) {
  BLU_CHECK(b >= 1 && T >= 1 && T <= model.max_seq_len() && reps >= 1, "measure_model: expected b >= 1, 1 <= T <= ",
            model.max_seq_len(), ", reps >= 1; got b ", b, ", T ", T, ", reps ", reps);
  const Device dev = model.token_embedding().weight.device();
  ModelCosts m;
  m.blocks = int64_t(model.num_blocks());
  m.seq_len = T;
  m.width = model.token_embedding().weight.size(1);
  double in_blocks = 0;
  for (const models::BlockRef& br : model.blocks()) in_blocks += double(br.module->num_parameters());
  m.block_params = in_blocks / double(std::max<int64_t>(1, m.blocks));
  m.other_params = double(model.num_parameters()) - in_blocks;
  const DType cdt = model.compute_dtype();
  const DType pdt = model.token_embedding().weight.dtype();
  m.param_bytes = m.grad_bytes = double(dtype_size(pdt));
  m.optim_bytes = 2.0 * double(dtype_size(pdt));
  m.compute_copy_bytes = cdt == pdt ? 0.0 : double(dtype_size(cdt));
  m.activation_elem_bytes = double(dtype_size(cdt));

  const bool was_training = model.is_training();
  model.train(true);
  Generator gen(1234);
  auto ids = [&](int64_t n) {
    Tensor t = randint(0, model.vocab_size(), {n, T}, DType::i64, kCPU, &gen);
    return dev.is_cpu() ? t : to_device(t, dev);
  };
  const Tensor x1 = ids(b), x2 = ids(2 * b);
  const Probe full1 = probe(model, x1, true, reps), full2 = probe(model, x2, true, reps);
  const Probe none1 = probe(model, x1, false, reps), none2 = probe(model, x2, false, reps);
  model.train(was_training);
  const double L = double(std::max<int64_t>(1, m.blocks));
  fit(double(b), none1.seconds, none2.seconds, m.other_fixed_s, m.other_per_seq_s);
  fit(double(b), (full1.seconds - none1.seconds) / L, (full2.seconds - none2.seconds) / L, m.block_fixed_s,
      m.block_per_seq_s);
  m.other_act_bytes = std::max(0.0, none2.act_bytes / double(2 * b));
  m.block_act_bytes = std::max(0.0, (full2.act_bytes - none2.act_bytes) / (L * double(2 * b)));

  // The update: AdamW on the model's device and dtype, gated as in training, at two sizes; the
  // slope is the cost per parameter (a launch and the host's wait, which one call of the real step
  // pays once for all parameters, would dominate a single small size on a GPU: 5x too high at 2^20).
  {
    NoGradGuard no_grad;
    auto timed = [&](int64_t n) {
      auto make = [&] { return zeros({n}, pdt, dev); };
      AdamWTensors t{make(), make(), make(), make(), Tensor()};
      std::vector<double> times;
      for (int r = -1; r < reps; ++r) {
        settle(t.param);
        const double t0 = now();
        adamw_step_({t}, AdamWStepArgs{1e-4, 0.9, 0.95, 1e-8, 0.1, r + 2}, NormGate{sum_squares({t.grad}), 1.0});
        settle(t.param);
        if (r >= 0) times.push_back(now() - t0);
      }
      std::sort(times.begin(), times.end());
      return times[times.size() / 2];
    };
    const int64_t n1 = int64_t(1) << 18, n2 = int64_t(1) << (dev.is_cuda() ? 24 : 20);
    const double t1 = timed(n1), t2 = timed(n2);
    m.update_per_param_s = t2 > t1 ? (t2 - t1) / double(n2 - n1) : t2 / double(n2);
  }
  return m;
}

LinkCosts measure_link(ProcessGroup& pg, Device dev, int reps) {
  BLU_CHECK(reps >= 1, "measure_link: reps must be >= 1, got ", reps);
  LinkCosts l;
  if (pg.size() <= 1) return l;
  auto timed = [&](int64_t elems) {
    Tensor t = zeros({elems}, DType::f32, dev);
    std::vector<double> times;
    for (int r = -1; r < reps; ++r) {
      pg.barrier()->wait();
      const double t0 = now();
      pg.all_reduce(t)->wait();
      settle(t);
      if (r >= 0) times.push_back(now() - t0);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  // The large size must be bandwidth-bound: 4 MiB over NVLink is still mostly latency (its slope
  // came out as infinite bandwidth on 2×H200), 64 MiB is not.
  const int64_t large_elems = int64_t(1) << (dev.is_cuda() ? 24 : 20);
  const double small = timed(1024), large = timed(large_elems);
  const int n = pg.size();
  // ring(bytes) = 2(n-1)·lat + 2(n-1)/n · bytes / bw, through both sizes.
  const double k = 2.0 * (n - 1) / n, bytes_small = 4096.0, bytes_large = 4.0 * double(large_elems);
  const double per_byte = std::max(1e-15, (large - small) / (k * (bytes_large - bytes_small)));
  l.bytes_per_s = 1.0 / per_byte;
  l.latency_s = std::max(0.0, (small - k * bytes_small * per_byte) / (2.0 * (n - 1)));
  l.overlaps_compute = dev.is_cuda();
  return l;
}

Prediction predict(const Layout& layout, const ModelCosts& m, const LinkCosts& link, const PlanJob& job) {
  Prediction p;
  p.layout = layout;
  const int dp = layout.dp, pp = layout.pp, tp = layout.tp;
  const bool piped = pp > 1 || layout.micro_batches > 0;
  // The replica with the largest share bounds the step.
  double share = 0;
  for (double w : layout.replica_weights) share = std::max(share, w);
  if (layout.replica_weights.empty()) share = 1.0 / dp;
  const double seqs = double(job.batch) * share;
  const double micro = piped ? double(std::max<int64_t>(1, layout.micro_batches)) : double(job.grad_accum);
  const double b = seqs / micro;  // sequences per micro-batch

  // Blocks per stage: the largest stage bounds the pipeline.
  int64_t max_blocks = m.blocks;
  if (!layout.stage_blocks.empty()) {
    max_blocks = 0;
    // With chunks, rank r runs virtual stages r, r + pp, …: sum its chunks.
    for (int r = 0; r < pp; ++r) {
      int64_t n = 0;
      for (size_t s = size_t(r); s < layout.stage_blocks.size(); s += size_t(pp))
        n += layout.stage_blocks[s].second - layout.stage_blocks[s].first + 1;
      max_blocks = std::max(max_blocks, n);
    }
  }
  const double tp_width = layout.tp_widths.empty() ? 1.0 / tp : *std::max_element(layout.tp_widths.begin(), layout.tp_widths.end());
  const double block_t = m.block_fixed_s + m.block_per_seq_s * b * tp_width;
  // Embedding and head sit on the first and last stages; with a pipeline the busier of the two
  // carries them (the head dominates), without one the single stage carries both.
  const double other_t = m.other_fixed_s + m.other_per_seq_s * b * tp_width;
  const double stage_compute = double(max_blocks) * block_t + other_t;

  // Tensor parallelism: per block two all-reduces forward and two backward of [b, T, C]
  // (sequence parallel: all-gathers and reduce-scatters of the same total volume).
  const double act = b * double(m.seq_len * m.width) * m.activation_elem_bytes;
  const double tp_comm = tp > 1 ? double(max_blocks) * 4.0 * ring(act, tp, link) + 2.0 * ring(act, tp, link) : 0.0;
  // Pipeline: an activation forward and its gradient backward per micro-batch and stage boundary.
  const double p2p = pp > 1 ? 2.0 * (link.latency_s + act / tp / link.bytes_per_s) : 0.0;
  const double slot = stage_compute + tp_comm + p2p;  // one micro-batch's forward + backward on a stage
  const double v = double(std::max(1, layout.chunks));
  double pipeline_t = micro * slot;
  double bubble = 0;
  if (pp > 1) {
    // GPipe and 1F1B idle (pp − 1) slots per step; interleaving divides a slot by the chunk count.
    bubble = double(pp - 1) * slot / (layout.schedule == Schedule::interleaved ? v : 1.0);
    pipeline_t += bubble;
  }
  p.compute_s = micro * stage_compute;
  p.tp_comm_s = micro * tp_comm;
  p.pp_comm_s = micro * p2p;
  p.bubble_s = bubble;

  // Data parallelism over this rank's parameters: DDP all-reduces the gradients; ZeRO-1/2
  // reduce-scatter them and all-gather the updated parameters (the same volume); ZeRO-3 gathers
  // the parameters again for forward and backward.
  const double rank_params = (double(max_blocks) * m.block_params + m.other_params) / tp;
  const double grad_bytes = rank_params * m.grad_bytes;
  double dp_comm = 0;
  if (dp > 1) {
    dp_comm = layout.zero == 0 ? ring(grad_bytes, dp, link)
                               : half_ring(grad_bytes, dp, link) + half_ring(rank_params * m.param_bytes, dp, link);
    // DDP issues each bucket's all-reduce as backward fills it: where the link runs beside the
    // compute, only what outlasts the last micro-batch's backward (two thirds of its forward +
    // backward) stays on the step, and at least the last bucket's (DDPOptions::bucket_mib).
    if (layout.zero == 0 && link.overlaps_compute) {
      const double backward_t = 2.0 / 3.0 * slot;
      const double bucket = DDPOptions{}.bucket_mib * 1048576.0;
      dp_comm = std::max(ring(std::min(grad_bytes, bucket), dp, link), dp_comm - backward_t);
    }
    if (layout.zero == 3) dp_comm += 2.0 * micro * half_ring(rank_params * m.param_bytes, dp, link);
  }
  p.dp_comm_s = dp_comm;
  const double update_params = layout.zero >= 1 ? rank_params / dp : rank_params;
  p.update_s = update_params * m.update_per_param_s;
  p.step_s = pipeline_t + dp_comm + p.update_s;

  // Memory of the most loaded rank (stage 0 under 1F1B keeps pp micro-batches in flight).
  const double shard = double(dp);
  double state = rank_params * (m.param_bytes + m.compute_copy_bytes) / (layout.zero == 3 ? shard : 1.0) +
                 rank_params * m.grad_bytes / (layout.zero >= 2 ? shard : 1.0) +
                 rank_params * m.optim_bytes / (layout.zero >= 1 ? shard : 1.0);
  if (layout.zero == 3) state += (m.block_params / tp) * (m.param_bytes + m.compute_copy_bytes) * 2.0;  // gathered blocks
  double in_flight = 1;
  if (pp > 1) in_flight = layout.schedule == Schedule::gpipe ? micro : std::min(micro, double(pp));
  const double acts = in_flight * b * (double(max_blocks) * m.block_act_bytes + m.other_act_bytes) / tp;
  p.state_bytes = state;
  p.activation_bytes = acts;
  p.memory_bytes = state + acts;
  p.fits = job.memory_budget <= 0 || p.memory_bytes <= job.memory_budget;
  return p;
}

std::string Prediction::describe() const {
  std::ostringstream os;
  os << std::fixed << std::setprecision(4) << "step " << step_s << " s (compute " << compute_s;
  if (tp_comm_s > 0) os << ", tp comm " << tp_comm_s;
  if (pp_comm_s > 0) os << ", pp sends " << pp_comm_s;
  if (bubble_s > 0) os << ", bubble " << bubble_s;
  if (dp_comm_s > 0) os << ", dp comm " << dp_comm_s;
  os << ", update " << update_s << "), " << std::setprecision(1) << memory_bytes / double(1 << 20)
     << " MiB per rank";
  return os.str();
}

std::string layout_text(const Layout& l, const std::vector<std::string>& names) {
  std::ostringstream os;
  std::string inner;
  if (l.tp > 1) {
    inner = "split(" + std::to_string(l.tp) + (l.sequence_parallel ? ", sp=true" : "") + ")";
  }
  if (l.pp > 1 || l.micro_batches > 0) {
    std::ostringstream p;
    p << "pipeline(" << l.pp << ", schedule=" << schedule_name(l.schedule) << ", micro=" << l.micro_batches;
    if (l.chunks > 1) p << ", chunks=" << l.chunks;
    p << ") {";
    for (const auto& [first, last] : l.stage_blocks) {
      p << " stage(" << names.at(size_t(first)) << (first == last ? "" : "-" + names.at(size_t(last))) << ")";
      if (!inner.empty()) p << " { " << inner << " }";
    }
    p << " }";
    inner = p.str();
  }
  if (l.dp > 1 || inner.empty()) {
    os << "replicate(" << l.dp;
    if (l.zero) os << ", zero=" << l.zero;
    os << ")";
    if (!inner.empty()) os << " { " << inner << " }";
    return os.str();
  }
  return inner;
}

std::vector<Prediction> plan(const ModelCosts& m, const LinkCosts& link, const PlanJob& job,
                             const std::vector<std::string>& names, int64_t heads, int64_t kv_heads, int64_t vocab) {
  BLU_CHECK(job.world >= 1 && job.batch >= 1, "plan: expected world >= 1 and batch >= 1, got ", job.world, " and ",
            job.batch);
  std::vector<Prediction> out;
  const int64_t L = int64_t(names.size());
  for (int tp = 1; tp <= job.world; ++tp) {
    if (job.world % tp || heads % tp || kv_heads % tp || vocab % tp) continue;
    for (int pp = 1; pp * tp <= job.world; ++pp) {
      if ((job.world / tp) % pp) continue;
      const int dp = job.world / tp / pp;
      if (job.batch % dp) continue;
      const std::vector<Schedule> schedules =
          pp > 1 ? std::vector<Schedule>{Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved}
                 : std::vector<Schedule>{Schedule::one_f_one_b};
      for (Schedule s : schedules) {
        const int chunks = s == Schedule::interleaved ? 2 : 1;
        if (L % (int64_t(pp) * chunks)) continue;  // only even stages here; uneven ones are asked for
        std::vector<int64_t> micros = {1};
        if (pp > 1) micros = {pp, 2 * int64_t(pp), 4 * int64_t(pp)};
        for (int64_t micro : micros) {
          if ((job.batch / dp) % micro) continue;
          // ZeRO shards replicas of one rank each: the runtime refuses it over TP or pipelined
          // replicas (train/layout_setup.h), so those layouts are not candidates.
          for (int zero = 0; zero <= (dp > 1 && tp == 1 && pp == 1 ? 3 : 0); ++zero) {
            Layout l;
            l.dp = dp, l.pp = pp, l.tp = tp, l.zero = zero;
            l.replica_weights.assign(size_t(dp), 1.0 / dp);
            l.tp_widths.assign(size_t(tp), 1.0 / tp);
            if (pp > 1) {
              l.schedule = s, l.micro_batches = micro, l.chunks = chunks;
              const int64_t per = L / (int64_t(pp) * chunks);
              for (int64_t v = 0; v < int64_t(pp) * chunks; ++v) l.stage_blocks.push_back({v * per, (v + 1) * per - 1});
            }
            Prediction p = predict(l, m, link, job);
            p.text = layout_text(l, names);
            out.push_back(std::move(p));
          }
        }
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.step_s < b.step_s;
  });
  return out;
}

}  // namespace blu::dist
