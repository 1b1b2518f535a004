#include "blu/dist/tensor_parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <tuple>

#include "blu/autograd/function.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/sharding_check.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu::dist {

namespace {

int64_t norm_dim(const Tensor& t, int64_t dim) { return dim < 0 ? dim + t.dim() : dim; }

// --- collectives without autograd: the forward and backward halves of the functions below ---

Tensor all_reduced(const Tensor& x, ProcessGroup& pg, ReduceOp op = ReduceOp::sum) {
  NoGradGuard no_grad;
  Tensor t = clone(x);  // the caller's tensor may be saved by another node: reduce a copy
  pg.all_reduce(t, op)->wait();
  return t;
}

// cat over ranks of x along `dim`.
Tensor gathered(const Tensor& x, int64_t dim, ProcessGroup& pg) {
  NoGradGuard no_grad;
  dim = norm_dim(x, dim);
  const Tensor in = contiguous(x);
  Shape os{int64_t(pg.size())};
  os.insert(os.end(), in.shape().begin(), in.shape().end());
  Tensor out = empty(os, in.dtype(), in.device());  // [W, d0, …]
  pg.all_gather(out, in)->wait();
  if (dim == 0) return reshape(out, [&] { Shape s = in.shape(); s[0] *= pg.size(); return s; }());
  // [W, d0, …, d_dim, …] → [d0, …, W, d_dim, …] → merge W into d_dim.
  Shape perm;
  for (int64_t i = 1; i <= dim; ++i) perm.push_back(i);
  perm.push_back(0);
  for (int64_t i = dim + 1; i <= in.dim(); ++i) perm.push_back(i);
  Shape s = in.shape();
  s[size_t(dim)] *= pg.size();
  return reshape(permute(out, perm), s);
}

// cat over ranks of x along `dim`, rank q's piece `lengths[q]` long there (empty: all alike):
// each padded to the longest, gathered, and the padding dropped.
Tensor gathered_uneven(const Tensor& x, int64_t dim, ProcessGroup& pg, const std::vector<int64_t>& lengths) {
  if (lengths.empty()) return gathered(x, dim, pg);
  NoGradGuard no_grad;
  dim = norm_dim(x, dim);
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  Tensor padded = x;
  if (x.size(dim) < longest) {
    Shape pad = x.shape();
    pad[size_t(dim)] = longest - x.size(dim);
    padded = cat({x, zeros(pad, x.dtype(), x.device())}, dim);
  }
  const Tensor all = gathered(padded, dim, pg);
  std::vector<Tensor> pieces;
  for (size_t q = 0; q < lengths.size(); ++q) pieces.push_back(narrow(all, dim, int64_t(q) * longest, lengths[q]));
  return contiguous(cat(pieces, dim));
}

// A collective under way: `out` holds its result once `work` is done; `in` is what it reads,
// kept alive until then.
struct Pending {
  Tensor out, in;
  WorkPtr work;
  Tensor finish() {
    work->wait();
    work.reset();
    in = Tensor();
    return std::exchange(out, Tensor());
  }
};

// Starts chunk `rank` along `dim` of the sum over ranks of x.
Pending start_reduce_scatter(const Tensor& x, int64_t dim, ProcessGroup& pg) {
  NoGradGuard no_grad;
  dim = norm_dim(x, dim);
  const int64_t W = pg.size(), n = x.size(dim);
  BLU_CHECK(n % W == 0, "sequence parallelism over ", W, " ranks: the sequence length ", n,
            " (dim ", dim, " of ", x.shape(), ") is not divisible by ", W);
  Shape local = x.shape();
  local[size_t(dim)] = n / W;
  // [d0, …, W·L, …] → [W, d0, …, L, …] contiguous: chunk w is rank w's.
  Shape split = x.shape();
  split[size_t(dim)] = n / W;
  split.insert(split.begin() + dim, W);
  Shape perm{dim};
  for (int64_t i = 0; i < int64_t(split.size()); ++i)
    if (i != dim) perm.push_back(i);
  Pending p;
  p.in = contiguous(permute(reshape(x, split), perm));
  p.out = empty(local, x.dtype(), x.device());
  p.work = pg.reduce_scatter(p.out, p.in);
  return p;
}

// Chunk `rank` of x along `dim` — of the sum over ranks when `reduce`, else of this rank's x.
Tensor scattered(const Tensor& x, int64_t dim, ProcessGroup& pg, bool reduce) {
  if (reduce) return start_reduce_scatter(x, dim, pg).finish();
  NoGradGuard no_grad;
  dim = norm_dim(x, dim);
  const int64_t W = pg.size(), n = x.size(dim);
  BLU_CHECK(n % W == 0, "sequence parallelism over ", W, " ranks: the sequence length ", n,
            " (dim ", dim, " of ", x.shape(), ") is not divisible by ", W);
  return contiguous(narrow(x, dim, pg.rank() * (n / W), n / W));
}

Shape local_shape(const ShardInfo& s) {
  Shape sh = s.full_shape;
  if (s.sharded()) sh[size_t(s.dim)] = s.parts * s.length;
  return sh;
}

// This rank's length of `seg` elements cut into units apportioned as `counts` (empty: pg.size()
// equal pieces), and its offset; BLU_CHECK that the cut is whole.
std::pair<int64_t, int64_t> piece(int64_t seg, const ProcessGroup& pg, const std::vector<int64_t>& counts,
                                  const Shape& shape) {
  const int r = pg.rank();
  if (counts.empty()) {
    BLU_CHECK(seg % pg.size() == 0, "tensor parallelism over ", pg.size(), " ranks: ", seg, " elements of ", shape,
              " do not split evenly");
    return {int64_t(r) * (seg / pg.size()), seg / pg.size()};
  }
  BLU_ASSERT(int(counts.size()) == pg.size(), "tensor parallelism: ", counts.size(), " shares for ", pg.size(), " ranks");
  int64_t units = 0, before = 0;
  for (size_t q = 0; q < counts.size(); ++q) {
    units += counts[q];
    if (int(q) < r) before += counts[q];
  }
  BLU_CHECK(units > 0 && seg % units == 0, "tensor parallelism over ", pg.size(), " ranks: ", seg, " elements of ",
            shape, " do not cut into ", units, " units");
  const int64_t unit = seg / units;
  return {before * unit, counts[size_t(r)] * unit};
}

ShardInfo split_info(const Tensor& full, int64_t dim, int64_t parts, const ProcessGroup& pg,
                     const std::vector<int64_t>& counts) {
  ShardInfo s;
  s.dim = dim;
  s.parts = parts;
  s.full_shape = full.shape();
  BLU_CHECK(full.size(dim) % parts == 0, "tensor parallelism: dim ", dim, " of ", full.shape(), " is not ", parts,
            " equal segments");
  std::tie(s.offset, s.length) = piece(full.size(dim) / parts, pg, counts, full.shape());
  return s;
}

ShardInfo replicated_info(const Tensor& t, bool partial) {
  ShardInfo s;
  s.full_shape = t.shape();
  s.partial_grad = partial;
  return s;
}

// Copies `full`'s piece into `local` (no autograd).
void load_shard(const Tensor& local, const Tensor& full, const ShardInfo& info) {
  NoGradGuard no_grad;
  copy_(local, shard_of_full(full, info));
}

// The new module takes the old one's device, dtype, training flag and compute-copy setting.
void match(nn::Module& fresh, const Tensor& like, const nn::Module& old) {
  fresh.to(like.device());
  fresh.to(like.dtype());
  fresh.train(old.is_training());
  fresh.set_compute_copies(old.compute_copies_enabled());
}

int64_t linear_in(const nn::Linear& f, ParallelLinear::Kind k, const ProcessGroup& pg,
                  const std::vector<int64_t>& counts) {
  return k == ParallelLinear::Kind::row ? piece(f.in_features, pg, counts, f.weight.shape()).second : f.in_features;
}
int64_t linear_out(const nn::Linear& f, ParallelLinear::Kind k, const ProcessGroup& pg, int64_t parts,
                   const std::vector<int64_t>& counts) {
  if (k == ParallelLinear::Kind::row) return f.out_features;
  BLU_CHECK(f.out_features % parts == 0, "tensor parallelism: ", f.out_features, " output features are not ", parts,
            " equal segments");
  return parts * piece(f.out_features / parts, pg, counts, f.weight.shape()).second;
}

}  // namespace

Tensor shard_of_full(const Tensor& full, const ShardInfo& info) {
  if (!info.sharded()) return full;
  BLU_CHECK(full.shape() == info.full_shape, "shard_of_full: expected the full shape ", info.full_shape, ", got ",
            full.shape());
  const int64_t seg = full.size(info.dim) / info.parts;
  std::vector<Tensor> pieces;
  for (int64_t p = 0; p < info.parts; ++p) pieces.push_back(narrow(full, info.dim, p * seg + info.offset, info.length));
  return pieces.size() == 1 ? contiguous(pieces[0]) : cat(pieces, info.dim);
}

// --- autograd functions ---

namespace {
// Under a ShardingCheck: what the collective takes and gives (a sequence shard is dim 1 of [B, T, C]).
Tensor noted(const char* name, const Tensor& in, Placement want, const Tensor& out, Placement gives) {
  if (ShardingCheck* c = ShardingCheck::active()) c->collective(name, in, want, out, gives);
  return out;
}
Placement sequence_shard(const Tensor& t) { return Placement::shard(1 - t.dim()); }
}  // namespace

namespace {

std::atomic<int64_t> g_early{0}, g_shared{0};

// The collective over a column-parallel linear's input gradient, started early from inside that
// linear's backward (Note [Early input gradients], ops/early_grad.h) when the linear is the input's
// only consumer, and finished by the f / gather node.
struct EarlyCollective {
  int consumers = 1;
  Tensor grad;  // the linear's input gradient it was started on
  Pending pending;
};

// f (copy_to_tp) or, under sequence parallelism, gather_sequence, whose backward finishes the
// collective `early` started instead of starting one when there is one.
Tensor column_input(const Tensor& x, ProcessGroup& tp, bool sp, const std::shared_ptr<EarlyCollective>& early) {
  auto backward = [&tp, sp, early](const std::vector<Tensor>& g) {
    if (early->pending.work) {
      const Tensor started_on = std::exchange(early->grad, Tensor());
      BLU_ASSERT(g[0].storage() == started_on.storage() && g[0].raw_data() == started_on.raw_data(),
                 "tensor parallelism: the column input's gradient is not the one its collective started on");
      const Tensor r = early->pending.finish();  // sp: this rank's [B, T/W, C]; else the all-reduced [B·T, C]
      return std::vector<Tensor>{sp ? r : reshape(r, g[0].shape())};
    }
    return std::vector<Tensor>{sp ? scattered(g[0], 1, tp, true) : all_reduced(g[0], tp)};
  };
  if (sp) {
    return noted("gather_sequence", x, sequence_shard(x),
                 record_function("gather_sequence", {x}, {gathered(x, 1, tp)}, backward)[0], Placement::replicate());
  }
  return noted("copy_to_tp (f)", x, Placement::replicate(), record_function("copy_to_tp (f)", {x}, {x}, backward)[0],
               Placement::replicate());
}

}  // namespace

ColumnInputStats column_input_stats() { return {g_early.load(), g_shared.load()}; }

Tensor copy_to_tp(const Tensor& x, ProcessGroup& tp) {
  return noted("copy_to_tp (f)", x, Placement::replicate(), record_function("copy_to_tp (f)", {x}, {x}, [&tp](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{all_reduced(g[0], tp)};
  })[0], Placement::replicate());
}

Tensor reduce_from_tp(const Tensor& x, ProcessGroup& tp) {
  return noted("reduce_from_tp (g)", x, Placement::partial(),
               record_function("reduce_from_tp (g)", {x}, {all_reduced(x, tp)},
                               [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0]}; })[0],
               Placement::replicate());
}

Tensor gather_sequence(const Tensor& x, ProcessGroup& tp) {
  return noted("gather_sequence", x, sequence_shard(x),
               record_function("gather_sequence", {x}, {gathered(x, 1, tp)},
                               [&tp](const std::vector<Tensor>& g) {
                                 return std::vector<Tensor>{scattered(g[0], 1, tp, true)};
                               })[0],
               Placement::replicate());
}

Tensor reduce_scatter_sequence(const Tensor& x, ProcessGroup& tp) {
  return noted("reduce_scatter_sequence", x, Placement::partial(),
               record_function("reduce_scatter_sequence", {x}, {scattered(x, 1, tp, true)},
                               [&tp](const std::vector<Tensor>& g) {
                                 return std::vector<Tensor>{gathered(g[0], 1, tp)};
                               })[0],
               sequence_shard(x));
}

Tensor split_sequence(const Tensor& x, ProcessGroup& tp) {
  return noted("split_sequence", x, Placement::replicate(),
               record_function("split_sequence", {x}, {scattered(x, 1, tp, false)},
                               [&tp](const std::vector<Tensor>& g) {
                                 return std::vector<Tensor>{gathered(g[0], 1, tp)};
                               })[0],
               sequence_shard(x));
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab, ProcessGroup& tp,
                                    int64_t offset) {
  BLU_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
            "vocab_parallel_cross_entropy: expected logits [N, V/tp] and targets [N], got ", logits.shape(), " and ",
            targets.shape());
  const int64_t Vl = logits.size(1), off = offset >= 0 ? offset : int64_t(tp.rank()) * Vl;
  const int64_t cols = std::clamp<int64_t>(vocab - off, 0, Vl);  // this rank's real (unpadded) columns
  BLU_CHECK(cols > 0, "vocab_parallel_cross_entropy: rank ", tp.rank(), " owns columns [", off, ", ", off + Vl,
            ") of a vocabulary of ", vocab, ": none is real");
  constexpr int64_t kIgnore = -1;
  // The shard's statistics in one pass over its logits (no copy of them), combined over the ranks:
  // lse = M + log Σ_ranks exp(lse_r − M), M the largest lse_r; the target's logit, lse_r − row_loss_r,
  // from the rank that holds it.
  BLU_CHECK(vocab < (int64_t(1) << 24), "vocab_parallel_cross_entropy: a vocabulary of ", vocab,
            " is beyond the 2^24 ids the f32 index arithmetic holds exactly");
  Tensor lse, row_loss, valid, count;  // [N] each, statistics dtype; count 0-d (at least 1)
  {
    NoGradGuard no_grad;
    const Tensor x = contiguous(logits.detach());
    const CrossEntropyShard part = cross_entropy_shard(x, targets, cols, off, vocab, kIgnore);
    const DType sd = part.lse.dtype();
    const Tensor t = to_dtype(targets, sd);  // exact: ids below 2^24 (checked above)
    const Tensor owned = mul(to_dtype(gt(t, double(off) - 0.5), sd), to_dtype(lt(t, double(off + cols) - 0.5), sd));
    const Tensor m = all_reduced(part.lse, tp, ReduceOp::max);
    // One all-reduce for both sums: [2, N] = (exp(lse_r − M), target logit or 0).
    const Tensor both = all_reduced(
        stack({exp(sub(part.lse, m)), mul(sub(part.lse, part.row_loss), owned)}, 0), tp);
    lse = add(m, log(select(both, 0, 0)));
    valid = to_dtype(gt(t, double(kIgnore) + 0.5), sd);
    count = clamp(sum(valid), 1.0, std::numeric_limits<double>::infinity());
    row_loss = mul(sub(lse, select(both, 0, 1)), valid);
    if (ShardingCheck* c = ShardingCheck::active()) {
      c->set(lse, Placement::replicate());
      c->set(row_loss, Placement::replicate());
    }
  }
  Tensor loss = div(sum(row_loss), count);
  // Backward: (softmax − one-hot)·g/count on this rank's columns, written over the logits when
  // nothing else holds them (they are then the closure's alone: Note [Donated buffers]).
  return record_function(
      "vocab_parallel_cross_entropy", {logits}, {loss},
      [x = logits, targets, lse, valid, count, cols, off, vocab](const std::vector<Tensor>& g) mutable {
        const Tensor grad_rows = mul(valid, div(to_dtype(g[0], valid.dtype()), count));
        Tensor in = x;
        if (function_backward_is_last()) x = Tensor();  // the closure's handle goes now, not after
        const bool overwrite = !x.defined() && in.is_contiguous() && in.storage().use_count() == 1;
        return std::vector<Tensor>{
            cross_entropy_shard_backward(in, targets, lse, grad_rows, cols, off, vocab, kIgnore, overwrite)};
      })[0];
}

namespace {

std::atomic<int64_t> g_row_chunks{0};

// Note [Row chunks]
// A row-parallel linear's output is a partial sum that the next op (the residual add) needs whole,
// so its collective cannot run beside anything of the same rows. Cut into row pieces it can: the
// GEMM runs piece by piece, each piece's collective starts as soon as its GEMM is queued, and it
// runs beside the next piece's GEMM (on the NCCL group's stream, or the Gloo group's worker thread);
// only the last piece's collective is waited for with nothing beside it. Without sequence
// parallelism the pieces are ranges of the flattened rows and the collective an all-reduce, in
// place on the piece's GEMM output (nothing else holds it); with it they are ranges of the batch
// (a reduce-scatter along the sequence of whole sequences gives each rank its sequence shard of
// those rows) — fewer batch rows than pieces, fewer pieces. Each piece is its own linear node over
// a split of the input: the weight's gradient is the sum of the pieces' GEMMs (the same products
// summed in another order: fp32 rounding), the input's one cat (split's backward). The outputs
// are put together by one cat, which replaces the copy reduce_from_tp makes before reducing; the
// backward is g's (identity) or, under sequence parallelism, one all-gather of the whole gradient.
// A row-parallel linear's output: x · wᵀ, a partial sum over the ranks' input features, summed
// (or reduce-scattered along the sequence) over the group — in `chunks` row pieces when asked.
Tensor row_output(const Tensor& x, const Tensor& w, ProcessGroup& tp, bool sp, int64_t chunks) {
  BLU_ASSERT(x.dim() >= 2, "row-parallel linear: input ", x.shape());
  const int64_t in = x.shape().back();
  const Tensor rows = sp ? x : reshape(x, {x.numel() / in, in});  // sp: [B, T, in], split along B
  const int64_t n = rows.size(0), k = std::min(chunks, n);
  if (k < 2) return sp ? reduce_scatter_sequence(linear(x, w), tp) : reduce_from_tp(linear(x, w), tp);
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < k; ++i) sizes.push_back(n / k + (i < n % k ? 1 : 0));
  const std::vector<Tensor> pieces = split(rows, sizes, 0);
  std::vector<Tensor> partial;   // each piece's partial sum
  std::vector<Pending> pending;  // its collective
  for (const Tensor& p : pieces) {
    partial.push_back(linear(p, w));
    NoGradGuard no_grad;
    if (sp) {
      pending.push_back(start_reduce_scatter(partial.back(), 1, tp));
    } else {
      Pending d;
      d.out = partial.back();
      d.work = tp.all_reduce(d.out);
      pending.push_back(std::move(d));
    }
    g_row_chunks.fetch_add(1, std::memory_order_relaxed);
  }
  Tensor out;
  {
    NoGradGuard no_grad;
    std::vector<Tensor> done;
    for (Pending& d : pending) done.push_back(d.finish());
    out = cat(done, 0);
  }
  const char* name = sp ? "reduce_scatter_sequence" : "reduce_from_tp (g)";
  if (ShardingCheck* c = ShardingCheck::active())
    for (const Tensor& y : partial) c->collective(name, y, Placement::partial(), out, sp ? sequence_shard(out) : Placement::replicate());
  out = record_function(std::string(name) + " in row chunks", partial, {out},
                        [&tp, sp, sizes](const std::vector<Tensor>& g) {
                          return split(sp ? gathered(g[0], 1, tp) : g[0], sizes, 0);
                        })[0];
  if (sp) return out;
  Shape shape(x.shape().begin(), x.shape().end() - 1);
  shape.push_back(w.size(0));
  return reshape(out, shape);
}

}  // namespace

int64_t row_chunk_collectives() { return g_row_chunks.load(); }

// --- modules ---

struct ColumnInputs {
  bool on = true;  // false (BLU_TP_OVERLAP=0): every column linear its own f / gather, waited where issued
  int64_t row_chunks = 1;  // TPOptions::row_chunks (1 when BLU_TP_OVERLAP=0)
  Tensor fed;      // the tensor the last column linear was fed
  Tensor made;  // its f / gather output
  std::shared_ptr<EarlyCollective> early;
  void clear() {
    fed = made = Tensor();
    early.reset();
  }
};

ParallelLinear::ParallelLinear(const nn::Linear& full, Kind k, std::shared_ptr<ProcessGroup> tp, bool sp,
                               int64_t parts, std::vector<int64_t> counts, std::shared_ptr<ColumnInputs> inputs)
    : nn::Linear(linear_in(full, k, *tp, counts), linear_out(full, k, *tp, parts, counts), full.bias.defined()),
      kind(k),
      tp_(std::move(tp)),
      sp_(sp),
      inputs_(inputs ? std::move(inputs) : std::make_shared<ColumnInputs>()) {
  match(*this, full.weight, full);
  if (kind == Kind::row) {
    weight_info_ = split_info(full.weight, 1, 1, *tp_, counts);
    if (bias.defined()) bias_info_ = replicated_info(full.bias, sp_);
  } else {
    weight_info_ = split_info(full.weight, 0, parts, *tp_, counts);
    if (bias.defined()) bias_info_ = split_info(full.bias, 0, parts, *tp_, counts);
  }
  load_shard(weight, full.weight, weight_info_);
  if (bias.defined()) load_shard(bias, full.bias, bias_info_);
}

Tensor ParallelLinear::forward(const Tensor& x) const {
  const Tensor w = cast_param(weight, x.dtype()), b = cast_param(bias, x.dtype());
  switch (kind) {
    case Kind::column: {
      if (!GradMode::enabled() || !x.requires_grad() || !inputs_->on) {
        return linear(sp_ ? gather_sequence(x, *tp_) : copy_to_tp(x, *tp_), w, b);
      }
      ColumnInputs& in = *inputs_;
      if (in.fed.defined() && in.fed.is_same(x)) {
        ++in.early->consumers;
        g_shared.fetch_add(1, std::memory_order_relaxed);
        return linear(in.made, w, b);
      }
      in.fed = x;
      in.early = std::make_shared<EarlyCollective>();
      in.made = column_input(x, *tp_, sp_, in.early);
      // Rows flattened here so that the listener sits on the linear's own node.
      const Shape full = in.made.shape();
      Shape out_shape(full.begin(), full.end() - 1);
      out_shape.push_back(w.size(0));
      const Tensor y = linear(reshape(in.made, {numel(full) / full.back(), full.back()}), w, b);
      listen_for_input_grad(y, [early = in.early, tp = tp_, sp = sp_, full](size_t input, const Tensor& gx) {
        if (input != 0 || early->consumers != 1 || !gx.is_contiguous()) return;
        early->grad = gx;
        if (sp) {
          early->pending = start_reduce_scatter(reshape(gx, full), 1, *tp);
        } else {
          early->pending.out = gx;  // reduced in place: the linear made it and nothing else holds it
          early->pending.work = tp->all_reduce(gx);
        }
        g_early.fetch_add(1, std::memory_order_relaxed);
      });
      return reshape(y, out_shape);
    }
    case Kind::row: {
      inputs_->clear();
      const Tensor y = row_output(x, w, *tp_, sp_, inputs_->row_chunks);
      return b.defined() ? add(y, b) : y;
    }
    case Kind::head:
      break;
  }
  return linear(x, w, b);
}

Tensor ParallelLinear::forward(const Tensor& x, const Tensor& residual) const {
  if (kind == Kind::head) return linear(x, cast_param(weight, x.dtype()), cast_param(bias, x.dtype()), residual);
  return add(residual, forward(x));
}

ShardInfo ParallelLinear::shard_of(const Tensor& param) const {
  if (param.is_same(weight)) return weight_info_;
  BLU_CHECK(bias.defined() && param.is_same(bias), "ParallelLinear::shard_of: not one of this layer's parameters");
  return bias_info_;
}

VocabParallelEmbedding::VocabParallelEmbedding(const nn::Embedding& full, std::shared_ptr<ProcessGroup> tp,
                                               std::vector<int64_t> counts)
    : nn::Embedding(piece(full.weight.size(0), *tp, counts, full.weight.shape()).second, full.weight.size(1)),
      tp_(std::move(tp)) {
  BLU_CHECK(full.weight.size(0) < (int64_t(1) << 24), "VocabParallelEmbedding: ", full.weight.size(0),
            " rows are beyond the 2^24 ids the f32 index arithmetic holds exactly");
  match(*this, full.weight, full);
  info_ = split_info(full.weight, 0, 1, *tp_, counts);
  load_shard(weight, full.weight, info_);
}

Tensor VocabParallelEmbedding::forward(const Tensor& idx) const {
  const int64_t lo = info_.offset, rows = info_.length;
  Tensor local, keep;  // this rank's row of each id (0 when out of range), and 1/0 whether in range
  {
    NoGradGuard no_grad;
    // Ids as f32 (exact below 2^24: the constructor checks the table's rows).
    const Tensor f = to_dtype(idx, DType::f32);
    const Tensor in_range = mul(to_dtype(gt(f, double(lo) - 0.5), DType::f32),
                                to_dtype(lt(f, double(lo + rows) - 0.5), DType::f32));
    local = to_dtype(mul(add(f, -double(lo)), in_range), DType::i64);
    keep = unsqueeze(to_dtype(in_range, weight.dtype()), -1);
  }
  return reduce_from_tp(mul(embedding(weight, local), keep), *tp_);
}

ShardInfo VocabParallelEmbedding::shard_of(const Tensor& param) const {
  BLU_CHECK(param.is_same(weight), "VocabParallelEmbedding::shard_of: not this embedding's weight");
  return info_;
}

SequenceParallelLayerNorm::SequenceParallelLayerNorm(const nn::LayerNorm& full)
    : nn::LayerNorm(full.weight.size(0), full.bias.defined(), full.eps) {
  match(*this, full.weight, full);
  NoGradGuard no_grad;
  copy_(weight, full.weight);
  if (bias.defined()) copy_(bias, full.bias);
}

ShardInfo SequenceParallelLayerNorm::shard_of(const Tensor& param) const { return replicated_info(param, true); }

SequenceParallelRMSNorm::SequenceParallelRMSNorm(const nn::RMSNorm& full) : nn::RMSNorm(full.weight.size(0), full.eps) {
  match(*this, full.weight, full);
  NoGradGuard no_grad;
  copy_(weight, full.weight);
}

ShardInfo SequenceParallelRMSNorm::shard_of(const Tensor& param) const { return replicated_info(param, true); }

// --- the rewrite ---

std::vector<int64_t> apportion_units(int64_t units, int64_t group, const std::vector<double>& widths) {
  const int64_t W = int64_t(widths.size());
  BLU_CHECK(W >= 1 && group >= 1 && units % group == 0, "apportion_units: ", units, " units in groups of ", group,
            " over ", W, " ranks");
  const int64_t groups = units / group;
  BLU_CHECK(groups >= W, groups, " groups of ", group, " cannot give each of ", W, " ranks one");
  double total = 0;
  for (double w : widths) {
    BLU_CHECK(w > 0 && std::isfinite(w), "apportion_units: widths must be positive, got ", w);
    total += w;
  }
  // One group each, the rest by largest remainder of the shares.
  std::vector<int64_t> n(size_t(W), 1);
  const double rest = double(groups - W);
  std::vector<std::pair<double, int64_t>> frac;
  int64_t given = W;
  for (int64_t r = 0; r < W; ++r) {
    const double exact = double(groups) * widths[size_t(r)] / total - 1.0;
    const int64_t whole = std::max<int64_t>(0, int64_t(std::floor(std::min(exact, rest))));
    n[size_t(r)] += whole;
    given += whole;
    frac.push_back({-(exact - double(whole)), r});
  }
  std::sort(frac.begin(), frac.end());
  for (size_t i = 0; given < groups; i = (i + 1) % frac.size(), ++given) ++n[size_t(frac[i].second)];
  for (int64_t& x : n) x *= group;
  return n;
}

void apply_tensor_parallel(models::CausalLM& model, std::shared_ptr<ProcessGroup> tp, TPOptions options) {
  BLU_CHECK(tp, "apply_tensor_parallel: expected a process group");
  BLU_CHECK(options.row_chunks >= 1, "apply_tensor_parallel: row_chunks must be at least 1, got ", options.row_chunks);
  BLU_CHECK(!model.sharded.active(), "apply_tensor_parallel: the model is tensor-parallel already");
  const std::vector<models::ShardSpec> plan = model.tensor_parallel_plan();
  BLU_CHECK(!plan.empty(), "apply_tensor_parallel: the model family '", model.family(),
            "' declares no tensor-parallel plan (CausalLM::tensor_parallel_plan)");
  const int64_t W = tp->size();
  const bool uneven = !options.widths.empty();
  BLU_CHECK(!uneven || int64_t(options.widths.size()) == W, "tensor parallelism over ", W, " ranks: ",
            options.widths.size(), " widths given");
  using models::ShardRole;
  // Each split's units per rank (empty: equal shares).
  std::map<std::string, std::vector<int64_t>> counts;
  // Everything is checked before anything changes.
  for (const models::ShardSpec& s : plan) {
    nn::Module* m = model.find_module(s.module);
    BLU_CHECK(m, "apply_tensor_parallel: the plan names '", s.module, "', which the model does not have");
    const bool linear = dynamic_cast<nn::Linear*>(m) != nullptr;
    const bool ok = s.role == ShardRole::vocab_embedding ? dynamic_cast<nn::Embedding*>(m) != nullptr
                    : s.role == ShardRole::sequence_norm
                        ? dynamic_cast<nn::LayerNorm*>(m) != nullptr || dynamic_cast<nn::RMSNorm*>(m) != nullptr
                        : linear;
    BLU_CHECK(ok, "apply_tensor_parallel: '", s.module, "' is not of the type its role needs");
    if (s.units > 0 && !uneven) {
      BLU_CHECK(s.units % W == 0, "tensor parallelism over ", W, " ranks: ", s.module, ": ", s.units_name, " ", s.units,
                " is not divisible by ", W, " (split(", W, ", widths=[…]) cuts it unevenly)");
    }
    if (s.units > 0 && uneven) {
      BLU_CHECK(s.units % s.group == 0 && s.units / s.group >= W, "tensor parallelism over ", W, " ranks: ", s.module,
                ": ", s.units_name, " ", s.units, " in groups of ", s.group, " cannot give every rank one");
      if (s.role == ShardRole::vocab_embedding || s.role == ShardRole::vocab_head) {
        // The real tokens are apportioned, the padding rows (the table's end) go to the last rank:
        // every rank holds real rows however skewed the widths.
        const int64_t real = std::min(model.vocab_size(), s.units);
        std::vector<int64_t> c = apportion_units(real, 1, options.widths);
        c.back() += s.units - real;
        counts[s.module] = c;
      } else {
        counts[s.module] = apportion_units(s.units, s.group, options.widths);
      }
    }
    if (s.role == ShardRole::vocab_embedding || s.role == ShardRole::vocab_head) {
      const std::vector<int64_t> c = uneven ? counts[s.module] : std::vector<int64_t>(size_t(W), s.units / W);
      int64_t lo = 0;
      for (int64_t r = 0; r < W; ++r) {
        BLU_CHECK(lo < model.vocab_size(), "tensor parallelism over ", W, " ranks: ", s.module, ": rank ", r,
                  "'s rows [", lo, ", ", lo + c[size_t(r)], ") hold none of the ", model.vocab_size(), " real tokens");
        lo += c[size_t(r)];
      }
    }
  }
  const bool sp = options.sequence_parallel;
  // The vocabulary's rows per rank (the embedding's and a separate head's are cut alike), and this
  // rank's first row: the loss's column offset.
  std::vector<int64_t> vocab_rows;
  for (const models::ShardSpec& s : plan)
    if (s.role == ShardRole::vocab_embedding) vocab_rows = counts[s.module];
  int64_t vocab_offset = -1;
  if (!vocab_rows.empty()) {
    vocab_offset = 0;
    for (int q = 0; q < tp->rank(); ++q) vocab_offset += vocab_rows[size_t(q)];
  }
  const auto column_inputs = std::make_shared<ColumnInputs>();
  if (const char* e = std::getenv("BLU_TP_OVERLAP")) column_inputs->on = std::string(e) != "0";
  column_inputs->row_chunks = column_inputs->on ? options.row_chunks : 1;
  for (const models::ShardSpec& s : plan) {
    nn::Module* m = model.find_module(s.module);
    const std::vector<int64_t> c = counts[s.module];
    std::shared_ptr<nn::Module> fresh;
    switch (s.role) {
      case ShardRole::column:
        fresh = std::make_shared<ParallelLinear>(*dynamic_cast<nn::Linear*>(m), ParallelLinear::Kind::column, tp, sp,
                                                 s.parts, c, column_inputs);
        break;
      case ShardRole::row:
        fresh = std::make_shared<ParallelLinear>(*dynamic_cast<nn::Linear*>(m), ParallelLinear::Kind::row, tp, sp, 1, c,
                                                 column_inputs);
        break;
      case ShardRole::vocab_head:
        fresh = std::make_shared<ParallelLinear>(*dynamic_cast<nn::Linear*>(m), ParallelLinear::Kind::head, tp, sp, 1, c);
        break;
      case ShardRole::vocab_embedding:
        fresh = std::make_shared<VocabParallelEmbedding>(*dynamic_cast<nn::Embedding*>(m), tp, c);
        break;
      case ShardRole::sequence_norm:
        if (!sp) continue;  // replicated and run on the whole sequence: nothing to change
        if (auto* ln = dynamic_cast<nn::LayerNorm*>(m)) fresh = std::make_shared<SequenceParallelLayerNorm>(*ln);
        else fresh = std::make_shared<SequenceParallelRMSNorm>(*dynamic_cast<nn::RMSNorm*>(m));
        break;
    }
    model.replace_module(s.module, fresh);
  }
  models::ShardedSteps& steps = model.sharded;
  if (sp) steps.enter_blocks = [tp](const Tensor& x) { return split_sequence(x, *tp); };
  steps.sequence_shards = sp ? W : 1;
  steps.enter_head = [tp, sp](const Tensor& x) { return sp ? gather_sequence(x, *tp) : copy_to_tp(x, *tp); };
  steps.loss = [tp, vocab_offset](const Tensor& logits, const Tensor& targets, int64_t vocab) {
    return vocab_parallel_cross_entropy(logits, targets, vocab, *tp, vocab_offset);
  };
  steps.gather_logits = [tp, vocab_rows](const Tensor& logits) { return gathered_uneven(logits, -1, *tp, vocab_rows); };
}

// --- the inverse ---

bool is_tensor_parallel(nn::Module& model) {
  for (auto& [path, m] : model.named_modules())
    if (dynamic_cast<ShardedModule*>(m)) return true;
  return false;
}

std::vector<ShardedParameter> sharded_parameters(nn::Module& model) {
  std::map<std::string, ShardInfo> known;
  for (auto& [path, m] : model.named_modules()) {
    auto* s = dynamic_cast<ShardedModule*>(m);
    if (!s) continue;
    for (auto& [name, p] : m->named_parameters()) known[path.empty() ? name : path + "." + name] = s->shard_of(p);
  }
  std::vector<ShardedParameter> out;
  for (auto& [name, p] : model.named_parameters()) {
    auto it = known.find(name);
    out.push_back({name, p, it != known.end() ? it->second : replicated_info(p, false)});
  }
  return out;
}

ShardInfo shard_info(nn::Module& model, const Tensor& param) {
  for (const ShardedParameter& s : sharded_parameters(model))
    if (s.param.is_same(param)) return s.info;
  BLU_CHECK(false, "shard_info: ", param.str(), " is not a parameter of the model");
  return {};
}

nn::NamedTensors gather_full_state(nn::Module& model, ProcessGroup& tp) {
  NoGradGuard no_grad;
  nn::NamedTensors out;
  for (const ShardedParameter& s : sharded_parameters(model)) {
    if (!s.info.sharded()) {
      out.emplace_back(s.name, s.param.detach());
      continue;
    }
    const ShardInfo& i = s.info;
    BLU_ASSERT(s.param.shape() == local_shape(i), "the shard of ", s.name, " is ", s.param.shape(), ", expected ",
               local_shape(i));
    // Move the split dim to the front ([P·L, …]: P segments of this rank's L rows), pad each
    // segment to the longest rank's, gather ([W, P, Lmax, …]), and put segment p together from
    // every rank's first L_w rows of it, in rank order.
    Shape perm{i.dim};
    for (int64_t d = 0; d < s.param.dim(); ++d)
      if (d != i.dim) perm.push_back(d);
    const Tensor front = contiguous(permute(s.param, perm));
    Shape rest(front.shape().begin() + 1, front.shape().end());
    std::vector<int64_t> lengths;
    {
      const Tensor mine = full({1}, double(i.length), DType::f64, s.param.device());
      Tensor all = empty({int64_t(tp.size())}, DType::f64, s.param.device());
      tp.all_gather(all, mine)->wait();
      for (double v : to_vector(all)) lengths.push_back(int64_t(v));
    }
    const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    Shape seg{i.parts, i.length};
    seg.insert(seg.end(), rest.begin(), rest.end());
    Tensor mine = reshape(front, seg);  // [P, L, …]
    if (i.length < longest) {
      Shape pad = seg;
      pad[1] = longest - i.length;
      mine = cat({mine, zeros(pad, mine.dtype(), mine.device())}, 1);
    }
    const Tensor all = gathered(contiguous(mine), 0, tp);  // [W·P, Lmax, …]
    std::vector<Tensor> pieces;
    for (int64_t p = 0; p < i.parts; ++p)
      for (int w = 0; w < tp.size(); ++w)
        pieces.push_back(narrow(select(all, 0, int64_t(w) * i.parts + p), 0, 0, lengths[size_t(w)]));
    const Tensor full_front = cat(pieces, 0);
    Shape back(size_t(s.param.dim()));  // inverse of perm
    for (size_t d = 0; d < perm.size(); ++d) back[size_t(perm[d])] = int64_t(d);
    out.emplace_back(s.name, contiguous(permute(full_front, back)));
  }
  return out;
}

}  // namespace blu::dist
