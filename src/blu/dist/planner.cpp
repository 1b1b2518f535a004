#include "blu/dist/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <limits>
#include <sstream>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/ddp.h"
#include "blu/dist/hetero.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/dist/zero.h"
#include "blu/memory/allocator.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu::dist {

namespace {

// A replica weight as the layout's text states it: four significant digits.
std::string format_weight(double w) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", w);
  return buf;
}

// Each replica's pace: its slowest rank's speed in job.rank_speeds (row-major dp × pp × tp); empty
// when the job states no speeds for this many ranks.
std::vector<double> replica_paces(const PlanJob& job, int dp, int pp, int tp) {
  if (int(job.rank_speeds.size()) != job.world || job.world != dp * pp * tp) return {};
  std::vector<double> pace(static_cast<size_t>(dp));
  for (int i = 0; i < dp; ++i) {
    const auto first = job.rank_speeds.begin() + i * pp * tp;
    pace[size_t(i)] = *std::min_element(first, first + pp * tp);
  }
  return pace;
}

// Each tensor-parallel position's pace: the slowest speed at that position (rank % tp) over every
// replica and stage — one widths vector cuts every split of the layout; empty as replica_paces.
std::vector<double> tp_position_paces(const PlanJob& job, int tp) {
  if (int(job.rank_speeds.size()) != job.world || job.world % tp) return {};
  std::vector<double> pace(size_t(tp), std::numeric_limits<double>::infinity());
  for (int q = 0; q < job.world; ++q) pace[size_t(q % tp)] = std::min(pace[size_t(q % tp)], job.rank_speeds[size_t(q)]);
  return pace;
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Waits for the device by reading one element of `t` on the host.
void settle(const Tensor& t) {
  if (t.defined()) (void)to_vector(narrow(reshape(t, {t.numel()}), 0, 0, 1));
}

struct Probe {
  double seconds = 0;  // forward + backward, the median of reps
  double act_bytes = 0;  // allocator bytes live after forward, beyond those before it
};

enum class Span { whole, outside_blocks, embedding };

// Forward and backward of embed → blocks → head (whole), of embed → head (outside_blocks) or of
// the embedding alone (its output summed) on idx, timed `reps` times after one warm-up.
// With `lockstep`, every rank of it starts each repetition together (they probe at once).
Probe probe(models::CausalLM& model, const Tensor& idx, Span span, int reps, ProcessGroup* lockstep) {
  Allocator& alloc = allocator_for(idx.device());
  const std::vector<Tensor> params = model.parameters();
  std::vector<double> times;
  Probe p;
  for (int r = -1; r < reps; ++r) {
    model.zero_grad();
    if (lockstep) lockstep->barrier()->wait();  // on NCCL the stream waits for it: settled next
    settle(params.front());
    const int64_t before = alloc.stats().current_bytes;
    const double t0 = now();
    Tensor x = model.embed(idx);
    if (span == Span::whole)
      for (size_t i = 0; i < model.num_blocks(); ++i) x = model.block(i, x);
    // The ids as targets: any valid targets do.
    Tensor loss = span == Span::embedding ? sum(x) : model.head(x, idx).loss;
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

struct Parts {
  double block_fixed_s = 0, block_per_seq_s = 0, other_fixed_s = 0, other_per_seq_s = 0;
  double embed_fixed_s = 0, embed_per_seq_s = 0;
  double block_act_bytes = 0, other_act_bytes = 0, block_act_fixed_bytes = 0, other_act_fixed_bytes = 0;
};

// The blocks' and the rest's forward + backward, per call and per sequence, and the bytes each
// keeps per call and per sequence: probes at b and 2b with and without the blocks.
Parts probe_parts(models::CausalLM& model, int64_t b, int64_t T, int reps, ProcessGroup* lockstep) {
  const Device dev = model.token_embedding().weight.device();
  const bool was_training = model.is_training();
  model.train(true);
  Generator gen(1234);
  auto ids = [&](int64_t n) {
    Tensor t = randint(0, model.vocab_size(), {n, T}, DType::i64, kCPU, &gen);
    return dev.is_cpu() ? t : to_device(t, dev);
  };
  const Tensor x1 = ids(b), x2 = ids(2 * b);
  const Probe full1 = probe(model, x1, Span::whole, reps, lockstep), full2 = probe(model, x2, Span::whole, reps, lockstep);
  const Probe none1 = probe(model, x1, Span::outside_blocks, reps, lockstep), none2 = probe(model, x2, Span::outside_blocks, reps, lockstep);
  const Probe emb1 = probe(model, x1, Span::embedding, reps, lockstep), emb2 = probe(model, x2, Span::embedding, reps, lockstep);
  model.train(was_training);
  const double L = double(std::max<size_t>(1, model.num_blocks()));
  Parts p;
  fit(double(b), none1.seconds, none2.seconds, p.other_fixed_s, p.other_per_seq_s);
  fit(double(b), std::min(emb1.seconds, none1.seconds), std::min(emb2.seconds, none2.seconds), p.embed_fixed_s,
      p.embed_per_seq_s);
  fit(double(b), (full1.seconds - none1.seconds) / L, (full2.seconds - none2.seconds) / L, p.block_fixed_s,
      p.block_per_seq_s);
  fit(double(b), none1.act_bytes, none2.act_bytes, p.other_act_fixed_bytes, p.other_act_bytes);
  fit(double(b), (full1.act_bytes - none1.act_bytes) / L, (full2.act_bytes - none2.act_bytes) / L,
      p.block_act_fixed_bytes, p.block_act_bytes);
  return p;
}

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() const override { return true; }
};

// Rank 0 of `size` ranks whose collectives move no data: an all-reduce leaves its tensor as it
// is, an all-gather writes the input into every slot, a reduce-scatter keeps the first part. What
// a tensor-parallel rank computes runs unchanged on it (the shapes and the work; not the values).
class StandInGroup final : public ProcessGroup {
 public:
  StandInGroup(int size, Device dev) : size_(size), dev_(dev) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string backend() const override { return dev_.is_cuda() ? "nccl" : "gloo"; }
  void set_timeout(std::chrono::milliseconds) override {}
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(0); }
  void set_phase(std::string) override {}
  WorkPtr all_reduce(const Tensor&, ReduceOp) override { return done(); }
  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp) override {
    NoGradGuard no_grad;  // as a real group writes the bytes: outside autograd
    copy_(out, reshape(narrow(reshape(in, {in.numel()}), 0, 0, out.numel()), out.shape()));
    return done();
  }
  WorkPtr all_gather(const Tensor& out, const Tensor& in) override {
    NoGradGuard no_grad;
    const Tensor flat = reshape(out, {out.numel()}), src = reshape(in, {in.numel()});
    for (int i = 0; i < size_; ++i) copy_(narrow(flat, 0, int64_t(i) * in.numel(), in.numel()), src);
    return done();
  }
  WorkPtr broadcast(const Tensor&, int) override { return done(); }
  WorkPtr send(const Tensor&, int, int) override { BLU_CHECK(false, "StandInGroup: no point-to-point sends"); return nullptr; }
  WorkPtr recv(const Tensor&, int, int) override { BLU_CHECK(false, "StandInGroup: no point-to-point receives"); return nullptr; }
  WorkPtr barrier() override { return done(); }

 private:
  static WorkPtr done() { return std::make_shared<DoneWork>(); }
  int size_;
  Device dev_;
};

double ring(double bytes, int n, const LinkCosts& l) {  // all-reduce of `bytes` over n ranks
  if (n <= 1) return 0;
  return 2.0 * (n - 1) * l.latency_s + 2.0 * (n - 1) / n * bytes / l.bytes_per_s;
}

double half_ring(double bytes, int n, const LinkCosts& l) {  // reduce-scatter or all-gather
  if (n <= 1) return 0;
  return (n - 1) * l.latency_s + double(n - 1) / n * bytes / l.bytes_per_s;
}

}  // namespace

ModelCosts measure_model(models::CausalLM& model, int64_t b, int64_t T, int reps, ProcessGroup* lockstep) {
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
  // What the first and the last pipeline stage hold besides blocks: the embedding, the head (a
  // tied weight on both), and the rest (positions, the final norm) on both.
  const double emb = double(model.token_embedding().weight.numel());
  const double head = model.tied_embeddings() ? emb : double(model.output_weight().numel());
  const double rest = std::max(0.0, m.other_params - emb - (model.tied_embeddings() ? 0.0 : head));
  m.first_params = emb + rest;
  m.last_params = head + rest;
  m.tied_params = model.tied_embeddings() ? emb : 0.0;
  for (const Tensor& p : model.parameters()) m.largest_param = std::max(m.largest_param, double(p.numel()));
  const DType cdt = model.compute_dtype();
  const DType pdt = model.token_embedding().weight.dtype();
  m.param_bytes = m.grad_bytes = double(dtype_size(pdt));
  m.optim_bytes = 2.0 * double(dtype_size(pdt));
  m.compute_copy_bytes = cdt == pdt ? 0.0 : double(dtype_size(cdt));
  m.activation_elem_bytes = double(dtype_size(cdt));

  const Parts parts = probe_parts(model, b, T, reps, lockstep);
  m.block_fixed_s = parts.block_fixed_s, m.block_per_seq_s = parts.block_per_seq_s;
  m.other_fixed_s = parts.other_fixed_s, m.other_per_seq_s = parts.other_per_seq_s;
  m.embed_fixed_s = parts.embed_fixed_s, m.embed_per_seq_s = parts.embed_per_seq_s;
  m.block_act_bytes = parts.block_act_bytes, m.other_act_bytes = parts.other_act_bytes;
  m.block_act_fixed_bytes = parts.block_act_fixed_bytes, m.other_act_fixed_bytes = parts.other_act_fixed_bytes;
  // The compute copies the probe's forwards left (Note [Compute copies]; sibling linears keep
  // theirs as rows of one buffer, Note [Sibling linears]): their bytes per parameter.
  if (m.compute_copy_bytes > 0) {
    double copies = 0;
    for (const auto& [param, copy] : model.compute_copies())
      if (copy->tensor().defined()) copies += double(copy->tensor().nbytes());
    m.compute_copy_bytes = copies / std::max(1.0, double(model.num_parameters()));
  }

  // The update: AdamW on the model's device and dtype, gated as in training, at two sizes; the
  // slope is the cost per parameter (a launch and the host's wait, which one call of the real step
  // pays once for all parameters, would dominate a single small size on a GPU: 5x too high at 2^20).
  {
    NoGradGuard no_grad;
    auto timed = [&](int64_t n) {
      auto make = [&] { return zeros({n}, pdt, dev); };
      AdamWTensors t{make(), make(), make(), make(), Tensor(), Tensor()};
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

void measure_split(ModelCosts& m, models::CausalLM& copy, int tp, bool sequence_parallel, int64_t b, int reps,
                   ProcessGroup* lockstep) {
  BLU_CHECK(tp >= 2 && b >= 1 && reps >= 1 && m.seq_len >= 1, "measure_split: expected tp >= 2, b >= 1, reps >= 1 ",
            "and costs from measure_model; got tp ", tp, ", b ", b, ", reps ", reps, ", T ", m.seq_len);
  BLU_CHECK(int64_t(copy.num_blocks()) == m.blocks, "measure_split: the copy has ", copy.num_blocks(),
            " blocks, the measured model ", m.blocks);
  const Device dev = copy.token_embedding().weight.device();
  apply_tensor_parallel(copy, std::make_shared<StandInGroup>(tp, dev), TPOptions{.sequence_parallel = sequence_parallel});
  const int64_t early0 = column_input_stats().early;
  const Parts p = probe_parts(copy, b, m.seq_len, reps, lockstep);
  // probe_parts runs the blocks forward and backward 2·(reps + 1) times (at b and 2b, one warm-up each).
  const double early = double(column_input_stats().early - early0) / (2.0 * (reps + 1) * double(m.blocks));
  double partial = 0;
  for (const ShardedParameter& sp : sharded_parameters(copy))
    if (sp.info.partial_grad) partial += double(sp.param.numel()) * m.grad_bytes;
  m.splits.push_back({tp, sequence_parallel, p.block_fixed_s, p.block_per_seq_s, p.other_fixed_s, p.other_per_seq_s,
                      p.embed_fixed_s, p.embed_per_seq_s, p.block_act_bytes, p.other_act_bytes,
                      p.block_act_fixed_bytes, p.other_act_fixed_bytes, partial, early});
}

void take_slowest(ModelCosts& m, ProcessGroup& pg, Device dev) {
  std::vector<double*> times = {&m.block_fixed_s, &m.block_per_seq_s, &m.other_fixed_s, &m.other_per_seq_s,
                                &m.embed_fixed_s, &m.embed_per_seq_s, &m.update_per_param_s};
  for (ModelCosts::Split& s : m.splits)
    times.insert(times.end(), {&s.block_fixed_s, &s.block_per_seq_s, &s.other_fixed_s, &s.other_per_seq_s,
                               &s.embed_fixed_s, &s.embed_per_seq_s});
  std::vector<double> v;
  for (double* t : times) v.push_back(*t);
  Tensor t = from_vector(v, {int64_t(v.size())}, DType::f64);
  if (!dev.is_cpu()) t = to_device(t, dev);
  pg.all_reduce(t, ReduceOp::max)->wait();
  const std::vector<double> got = to_vector(t);
  for (size_t i = 0; i < times.size(); ++i) *times[i] = got[i];
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
      settle(t);  // on NCCL the barrier orders the stream only: the ranks have met once it is done
      const double t0 = now();
      pg.all_reduce(t)->wait();
      settle(t);
      if (r >= 0) times.push_back(now() - t0);
    }
    // The mean, not the median: a step pays the sum of its collectives. On CPU ranks their times
    // are bimodal (a waiting thread whose core went idle wakes late: a 4 KiB all-reduce of two
    // ranks on this 2-core machine has a median near 0.4 ms and a mean near 1.9), and the median
    // picks either mode from one run to the next.
    double sum = 0;
    for (double t : times) sum += t;
    return sum / double(times.size());
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
  const double micro = piped ? double(std::max<int64_t>(1, layout.micro_batches)) : double(job.grad_accum);
  // Each replica's rows per micro-batch, as the runtime splits them (dist::proportional_split):
  // the largest sets the memory and the collectives' volume (b); the compute is bounded by the
  // replica whose rows take longest at its slowest rank's speed, as rows at the speed the costs
  // were probed at (bt).
  const std::vector<double> even(size_t(dp), 1.0 / dp);
  const std::vector<double>& weights = layout.replica_weights.empty() ? even : layout.replica_weights;
  const bool uneven = std::any_of(weights.begin(), weights.end(), [&](double w) { return std::abs(w - 1.0 / dp) > 1e-9; });
  const double per_micro = double(job.batch) / micro;
  std::vector<double> replica_rows(size_t(dp), per_micro / dp);
  if (uneven && per_micro >= dp) {
    const std::vector<int64_t> r = proportional_split(int64_t(per_micro), weights);
    for (int i = 0; i < dp; ++i) replica_rows[size_t(i)] = double(r[size_t(i)]);
  } else if (uneven) {
    for (int i = 0; i < dp; ++i) replica_rows[size_t(i)] = per_micro * weights[size_t(i)];
  }
  const std::vector<double> paces = replica_paces(job, dp, pp, tp);
  const double slowest = paces.empty() ? 1.0 : *std::min_element(job.rank_speeds.begin(), job.rank_speeds.end());
  // bt: rows at the costs' speed; btw: the same for one split rank's share of them — the widest
  // share over its rank's speed, the longest over the replica's ranks (even shares on equal ranks:
  // bt / tp).
  const std::vector<double> even_widths(size_t(tp), 1.0 / tp);
  const std::vector<double>& widths = layout.tp_widths.empty() ? even_widths : layout.tp_widths;
  double b = 0, bt = 0, btw = 0;
  for (int i = 0; i < dp; ++i) {
    const double pace = paces.empty() ? 1.0 : paces[size_t(i)] / slowest;  // against the job's slowest rank
    b = std::max(b, replica_rows[size_t(i)]);
    bt = std::max(bt, replica_rows[size_t(i)] / pace);
    double share = 0;
    for (int q = i * pp * tp; q < (i + 1) * pp * tp; ++q)
      share = std::max(share, widths[size_t(q % tp)] / (paces.empty() ? 1.0 : job.rank_speeds[size_t(q)] / slowest));
    btw = std::max(btw, replica_rows[size_t(i)] * share);
  }

  // Blocks per pipeline rank: with chunks, rank r runs virtual stages r, r + pp, …
  std::vector<int64_t> blocks(size_t(pp), 0);
  if (layout.stage_blocks.empty()) {
    blocks.assign(size_t(pp), m.blocks / pp);
  } else {
    for (size_t s = 0; s < layout.stage_blocks.size(); ++s)
      blocks[s % size_t(pp)] += layout.stage_blocks[s].second - layout.stage_blocks[s].first + 1;
  }
  const auto first = [&](int r) { return r == 0; };
  const auto last = [&](int r) { return r == pp - 1; };
  // A probed split (measure_split) of this tp, with this sequence parallelism if there is one.
  const ModelCosts::Split* split = nullptr;
  if (tp > 1 && std::all_of(layout.tp_widths.begin(), layout.tp_widths.end(),
                            [&](double w) { return std::abs(w - 1.0 / tp) < 1e-9; }))
    for (const ModelCosts::Split& s : m.splits)
      if (s.tp == tp && (!split || s.sequence_parallel == layout.sequence_parallel)) split = &s;
  const double block_t = split ? split->block_fixed_s + split->block_per_seq_s * bt
                               : m.block_fixed_s + m.block_per_seq_s * btw;
  // Embedding, head and loss; of those the embedding runs on the first stage, the rest on the last.
  const double other_t = split ? split->other_fixed_s + split->other_per_seq_s * bt
                               : m.other_fixed_s + m.other_per_seq_s * btw;
  const double embed_t = std::min(other_t, split ? split->embed_fixed_s + split->embed_per_seq_s * bt
                                                 : m.embed_fixed_s + m.embed_per_seq_s * btw);

  // Tensor parallelism: per block two all-reduces forward and two backward of [b, T, C]
  // (sequence parallel: all-gathers and reduce-scatters of the same total volume), one for the
  // vocabulary-parallel embedding (first stage) and one for the head's input gradient and the
  // vocabulary-parallel loss's two over the rows — the maximum; the sum of exponentials with the
  // target's logit (last stage).
  const double act = b * double(m.seq_len * m.width) * m.activation_elem_bytes;
  const double rows = b * double(m.seq_len) * 4.0;
  // Pipeline: an activation forward and its gradient backward per micro-batch and stage boundary.
  const double p2p = pp > 1 ? 2.0 * (link.latency_s + act / tp / link.bytes_per_s) : 0.0;
  // One micro-batch's forward + backward on each rank; the busiest bounds the steady state, and
  // filling and draining the pipeline costs the others' slots once (divided by the chunks when
  // interleaved): for equal stages the (pp − 1) slots of GPipe's and 1F1B's bubble.
  std::vector<double> slot(size_t(pp), 0.0), compute(size_t(pp), 0.0), tp_comm(size_t(pp), 0.0);
  for (int r = 0; r < pp; ++r) {
    compute[size_t(r)] = double(blocks[size_t(r)]) * block_t + (first(r) ? embed_t : 0.0) + (last(r) ? other_t - embed_t : 0.0);
    if (tp > 1) {
      // Where the link runs beside the compute, a collective started early runs beside its
      // linear's weight-gradient GEMM: it leaves the step, up to that GEMM's time — taken as a
      // sixth of the block's forward + backward (GPT-2's c_attn and c_fc weight gradients are
      // 14 of its 72 GEMM flops per token and C²).
      const double early = split && link.overlaps_compute ? split->early_per_block : 0.0;
      const double hidden = std::min(early * ring(act, tp, link), block_t / 6.0);
      // The two row linears' forward collectives, each in k row pieces (Note [Row chunks],
      // tensor_parallel.cpp): k collectives of act/k, of which the first k − 1 run beside the
      // next piece's GEMM where the link overlaps compute, up to that GEMM's time — a row linear's
      // forward taken as a fourteenth of the block's forward + backward (GPT-2's two row GEMMs are
      // 5 of the block's 36 GEMM flops per token and C² over forward and backward).
      const double k = double(std::max<int64_t>(1, layout.tp_row_chunks));
      const double piece = ring(act / k, tp, link);
      const double row_fwd = 2.0 * (k * piece - (link.overlaps_compute ? std::min((k - 1.0) * piece,
                                                                                   (k - 1.0) / k * block_t / 14.0)
                                                                       : 0.0));
      tp_comm[size_t(r)] = double(blocks[size_t(r)]) * (2.0 * ring(act, tp, link) + row_fwd - hidden) +
                           (first(r) ? ring(act, tp, link) : 0.0) +
                           (last(r) ? ring(act, tp, link) + ring(rows, tp, link) + ring(2.0 * rows, tp, link) : 0.0);
    }
    slot[size_t(r)] = compute[size_t(r)] + tp_comm[size_t(r)] + p2p;
  }
  const size_t busiest = size_t(std::max_element(slot.begin(), slot.end()) - slot.begin());
  const double v = double(std::max(1, layout.chunks));
  double others = 0;
  for (size_t r = 0; r < slot.size(); ++r)
    if (r != busiest) others += slot[r];
  const double bubble = pp > 1 ? others / (layout.schedule == Schedule::interleaved ? v : 1.0) : 0.0;
  double pipeline_t = micro * slot[busiest] + bubble;
  p.compute_s = micro * compute[busiest];
  // Once a step: the gradient norm's sharded part, and under sequence parallelism the replicated
  // parameters' partial gradients (one packed all-reduce).
  const double tp_step = tp > 1 ? ring(4.0, tp, link) +
                                      (split && layout.sequence_parallel ? ring(split->partial_grad_bytes, tp, link) : 0.0)
                                : 0.0;
  pipeline_t += tp_step;
  p.tp_comm_s = micro * tp_comm[busiest] + tp_step;
  p.pp_comm_s = micro * p2p;
  p.bubble_s = bubble;

  // Parameters per rank: its blocks, the embedding on the first stage, the head on the last (a
  // tied weight on both; one stage holds all); of a split, the widest rank's share.
  const double wmax = *std::max_element(widths.begin(), widths.end());
  std::vector<double> params(size_t(pp), 0.0);
  for (int r = 0; r < pp; ++r)
    params[size_t(r)] = (double(blocks[size_t(r)]) * m.block_params +
                         (pp == 1 ? m.other_params : (first(r) ? m.first_params : 0.0) + (last(r) ? m.last_params : 0.0))) *
                        wmax;
  const double rank_params = *std::max_element(params.begin(), params.end());

  // Data parallelism over each rank's parameters (the largest bounds the step): DDP all-reduces
  // the gradients; ZeRO-1/2 reduce-scatter them and all-gather the updated parameters (the same
  // volume); ZeRO-3 gathers the parameters again for forward and backward.
  const double grad_bytes = rank_params * m.grad_bytes;
  double dp_comm = 0;
  if (dp > 1) {
    dp_comm = layout.zero == 0 ? ring(grad_bytes, dp, link)
                               : half_ring(grad_bytes, dp, link) + half_ring(rank_params * m.param_bytes, dp, link);
    // DDP issues each bucket's all-reduce as backward fills it: where the link runs beside the
    // compute, only what outlasts the last micro-batch's backward (two thirds of its forward +
    // backward) stays on the step, and at least the last bucket's (DDPOptions::bucket_mib).
    if (layout.zero == 0 && link.overlaps_compute) {
      const double backward_t = 2.0 / 3.0 * slot[busiest];
      const double bucket = DDPOptions{}.bucket_mib * 1048576.0;
      dp_comm = std::max(ring(std::min(grad_bytes, bucket), dp, link), dp_comm - backward_t);
    }
    // ZeRO-3 works per unit (each block, and the rest): an all-gather of its parameters for
    // forward and again for backward, and a reduce-scatter of its gradient — no gather after the
    // update. Each collective pays the link's latency.
    if (layout.zero == 3) {
      const double units = double(blocks[0]) + 1.0, unit = rank_params / units;
      dp_comm = units * (half_ring(unit * m.grad_bytes, dp, link) + 2.0 * micro * half_ring(unit * m.param_bytes, dp, link));
    }
  }
  p.dp_comm_s = dp_comm;
  const double update_params = layout.zero >= 1 ? rank_params / dp : rank_params;
  p.update_s = update_params * m.update_per_param_s;
  p.step_s = pipeline_t + dp_comm + p.update_s;

  // Memory of the most loaded rank: its state as sharded, and the activations of the micro-batches
  // its schedule keeps in flight (all of them under GPipe; under 1F1B pp − r on rank r; one on the
  // last).
  const double shard = double(dp);
  p.memory_bytes = -1;
  for (int r = 0; r < pp; ++r) {
    const double n = params[size_t(r)];
    double state = n * (m.param_bytes + m.compute_copy_bytes) / (layout.zero == 3 ? shard : 1.0) +
                   n * m.grad_bytes / (layout.zero >= 2 ? shard : 1.0) + n * m.optim_bytes / (layout.zero >= 1 ? shard : 1.0);
    if (layout.zero == 3) {
      // Gathered units (Note [ZeRO-3], dist/zero3.cpp), the larger of two moments: the head's
      // backward, with the rest (embeddings, final norm, head) gathered, its whole gradient buffer
      // and the last block prefetched; a block's backward, with the rest's gradient buffer (held
      // through the backward), the block and its prefetched predecessor gathered, its gradient
      // buffer and two reductions in flight. (ZeRO-3 runs without tensor or pipeline parallelism.)
      const double unit = m.param_bytes + m.compute_copy_bytes;
      const double head = m.other_params * (unit + m.grad_bytes) + m.block_params * unit;
      const double block = m.other_params * m.grad_bytes + m.block_params * (2.0 * unit + 3.0 * m.grad_bytes);
      state += std::max(head, block);
    }
    if (layout.zero == 2) state += zero2_staging_bytes(n, m.largest_param, m.grad_bytes);  // at the default bucket size
    // The last stage needs no gradient from another: message-driven execution (the default) runs
    // each backward as soon as its forward is done, whatever the schedule, and keeps one.
    double in_flight = 1;
    if (pp > 1 && !last(r))
      in_flight = layout.schedule == Schedule::gpipe         ? micro
                  : layout.schedule == Schedule::interleaved ? std::min(micro, double(pp))
                                                             : std::min(micro, double(pp - r));
    const double per_seq = split ? double(blocks[size_t(r)]) * split->block_act_bytes + (last(r) ? split->other_act_bytes : 0.0)
                                 : (double(blocks[size_t(r)]) * m.block_act_bytes + (last(r) ? m.other_act_bytes : 0.0)) * wmax;
    const double fixed = split ? double(blocks[size_t(r)]) * split->block_act_fixed_bytes +
                                     (last(r) ? split->other_act_fixed_bytes : 0.0)
                               : (double(blocks[size_t(r)]) * m.block_act_fixed_bytes +
                                  (last(r) ? m.other_act_fixed_bytes : 0.0)) *
                                     wmax;
    const double acts = in_flight * (b * per_seq + fixed);
    // From the second micro-batch on a gradient is made apart and then added into the accumulated
    // one: the largest parameter's (a head or an embedding) is the most that is held twice.
    // (ZeRO-3 reduces each micro-batch's gradients from a fresh buffer instead.)
    const double accumulate = micro > 1 && layout.zero != 3 ? m.largest_param * m.grad_bytes * wmax : 0.0;
    // The tied weight's gradient exchange comes after the backward, when the activations are gone.
    const double tied = pp > 1 && (first(r) || last(r)) ? m.tied_params * m.grad_bytes * wmax : 0.0;
    double transient = std::max(acts + accumulate, tied);
    // One process, one micro-batch: the step drops the gradients before its forward (no bucket
    // holds them, no micro-batch adds into them), and the backward makes them as it frees the
    // activations — the peak is at its start, the activations and the head's gradient (made
    // first), or at its end, every gradient, whichever is more. (On an H200 counting every
    // gradient beside the activations over-predicted these steps by 6-11%.)
    if (dp == 1 && pp == 1 && micro == 1 && layout.zero == 0) {
      const double grads = n * m.grad_bytes;
      state -= grads;
      transient = std::max(acts + m.last_params * m.grad_bytes * wmax, grads);
    }
    p.stage_memory_bytes.push_back(state + transient);
    if (state + transient > p.memory_bytes) {
      p.state_bytes = state;
      p.activation_bytes = acts;
      p.memory_bytes = state + transient;
    }
  }
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
    std::ostringstream w;
    if (std::any_of(l.tp_widths.begin(), l.tp_widths.end(), [&](double x) { return std::abs(x - 1.0 / l.tp) > 1e-9; })) {
      w << ", widths=[";
      for (size_t i = 0; i < l.tp_widths.size(); ++i) w << (i ? "," : "") << std::setprecision(6) << l.tp_widths[i];
      w << "]";
    }
    inner = "split(" + std::to_string(l.tp) + w.str() + (l.sequence_parallel ? ", sp=true" : "") + ")";
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
    if (std::any_of(l.replica_weights.begin(), l.replica_weights.end(),
                    [&](double x) { return std::abs(x - 1.0 / l.dp) > 1e-9; })) {
      os << ", weights=[";
      for (size_t i = 0; i < l.replica_weights.size(); ++i)
        os << (i ? "," : "") << format_weight(l.replica_weights[i]);
      os << "]";
    }
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
    if (job.world % tp) continue;
    // Sizes the degree does not divide split unevenly (TPOptions::widths): the heads apportioned
    // as evenly as they go, in their key-value groups, and everything else in the same shares.
    std::vector<double> widths(size_t(tp), 1.0 / tp);
    if (heads % tp || kv_heads % tp || vocab % tp) {
      if (kv_heads < tp || heads % kv_heads || vocab < tp) continue;
      const std::vector<int64_t> counts = apportion_units(heads, heads / kv_heads, widths);
      for (int r = 0; r < tp; ++r) widths[size_t(r)] = double(counts[size_t(r)]) / double(heads);
    }
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
            l.tp_widths = widths;
            if (pp > 1) {
              l.schedule = s, l.micro_batches = micro, l.chunks = chunks;
              const int64_t per = L / (int64_t(pp) * chunks);
              for (int64_t v = 0; v < int64_t(pp) * chunks; ++v) l.stage_blocks.push_back({v * per, (v + 1) * per - 1});
            }
            Prediction p = predict(l, m, link, job);
            p.text = layout_text(l, names);
            out.push_back(std::move(p));
            // The replicas weighted by their speeds (each its slowest rank's), where they differ.
            if (const std::vector<double> pace = replica_paces(job, dp, pp, tp); dp > 1 && !pace.empty()) {
              const auto [lo, hi] = std::minmax_element(pace.begin(), pace.end());
              if (*lo > 0 && *hi >= kUnequalSpeeds * *lo && job.batch / micro >= dp) {
                Layout w = l;
                double total = 0;
                for (double x : pace) total += x;
                // Four significant digits, as the text states them (the runtime splits by the text).
                for (int i = 0; i < dp; ++i)
                  w.replica_weights[size_t(i)] = std::stod(format_weight(pace[size_t(i)] / total));
                Prediction q = predict(w, m, link, job);
                q.text = layout_text(w, names);
                out.push_back(std::move(q));
              }
            }
            // The split's shares by its positions' speeds (heads in their key-value groups, and
            // everything else in the same shares), where they differ.
            if (const std::vector<double> pace = tp_position_paces(job, tp); tp > 1 && !pace.empty()) {
              const auto [lo, hi] = std::minmax_element(pace.begin(), pace.end());
              if (*lo > 0 && *hi >= kUnequalSpeeds * *lo && kv_heads >= tp && heads % kv_heads == 0 && vocab >= tp) {
                double total = 0;
                for (double x : pace) total += x;
                std::vector<double> shares;
                for (double x : pace) shares.push_back(x / total);
                const std::vector<int64_t> counts = apportion_units(heads, heads / kv_heads, shares);
                Layout w = l;
                for (int r = 0; r < tp; ++r) w.tp_widths[size_t(r)] = double(counts[size_t(r)]) / double(heads);
                if (w.tp_widths != l.tp_widths) {
                  Prediction q = predict(w, m, link, job);
                  q.text = layout_text(w, names);
                  out.push_back(std::move(q));
                }
              }
            }
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
