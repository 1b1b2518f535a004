#include "blu/dist/strategy.h"

#include <cstdlib>

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/row_exchange.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/dist/zero.h"
#include "blu/dist/zero_checkpoint.h"
#include "blu/memory/memory_report.h"
#include "blu/models/causal_lm.h"
#include "blu/nn/layers.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/view.h"

namespace blu::dist {

namespace {

// An out-of-memory report counts the parameters' bytes as such, by name (a byte-less one is skipped).
void tag_parameters(nn::Module& model) {
  for (const auto& [name, p] : model.named_parameters())
    if (p.storage() && p.storage()->ptr()) tag_memory(p, MemoryCategory::parameters, name);
}

double host_value(const Tensor& t) { return t.device().is_cpu() ? t.item() : to_device(t, kCPU).item(); }


}  // namespace

// All-reduces `grads` in place, the small ones packed: runs of them of one dtype, up to 32 MiB, are
// copied into a flat buffer, reduced as one collective, and copied back; a large or non-contiguous
// one is reduced where it is. Many small tensors (norms' and biases' gradients) would otherwise pay
// a collective's latency each — on two CPU ranks about a millisecond apiece.
void all_reduce_packed(ProcessGroup& pg, const std::vector<Tensor>& grads, ReduceOp op) {
  constexpr int64_t kPackBytes = int64_t(32) << 20;
  std::map<DType, std::vector<Tensor>> packs;  // the pending run per dtype, as 1-D views
  const auto flush = [&](std::vector<Tensor>& list) {
    if (list.empty()) return;
    if (list.size() == 1) {
      pg.all_reduce(list.front(), op)->wait();
    } else {
      int64_t n = 0;
      for (const Tensor& g : list) n += g.numel();
      const Tensor flat = empty({n}, list.front().dtype(), list.front().device());
      std::vector<Tensor> slots;
      int64_t at = 0;
      for (const Tensor& g : list) {
        slots.push_back(narrow(flat, 0, at, g.numel()));
        at += g.numel();
      }
      copy_many_(slots, list);
      pg.all_reduce(flat, op)->wait();
      copy_many_(list, slots);
    }
    list.clear();
  };
  for (const Tensor& g : grads) {
    const int64_t bytes = g.numel() * int64_t(dtype_size(g.dtype()));
    if (!g.is_contiguous() || bytes >= kPackBytes) {
      pg.all_reduce(g, op)->wait();
      continue;
    }
    std::vector<Tensor>& list = packs[g.dtype()];
    int64_t held = 0;
    for (const Tensor& t : list) held += t.numel() * int64_t(dtype_size(t.dtype()));
    if (held + bytes > kPackBytes) flush(list);
    list.push_back(reshape(g, {g.numel()}));
  }
  for (auto& [dt, list] : packs) flush(list);
}

// Note [Tied rows on one device]
// A tied token embedding (GPT-2's wte) gets two gradients: the LM head's, dense and first, and its
// lookup's, one row per token and last. Through autograd the lookup's becomes a dense [V, C] tensor
// (zeroed, then the tokens' rows summed into it) that the leaf's accumulator adds into the head's:
// on GPT-2 124M (H200, B=16) a 154 MB memset, 55 µs of row sums and a 110 µs add, 0.2 ms a step.
// With no process group the Strategy gives such an embedding a row sink that adds the rows' sums
// into the weight's gradient in place (embedding_backward_add_, the same per-row sums in the same
// order: the gradient's bits are the dense path's but for a −0.0 the head left in a row no token
// reads, which stays −0.0). Only for a step of one micro-batch: with several, autograd adds each
// micro-batch's head and row gradients together before accumulating them, an association an
// in-place add cannot keep, and the plain loop's bits are the promise (strategy.h). DDP and ZeRO-2
// take the rows through their own sinks.
namespace {
void add_rows_to_grad(nn::Embedding& e, const Tensor& idx, const Tensor& g) {
  NoGradGuard no_grad;
  Tensor gw = e.weight.grad();
  if (!gw.defined()) {  // no other use gave a gradient yet: the leaf's slot (or a fresh one) holds zeros
    gw = e.weight.grad_slot();
    if (gw.defined()) fill_(gw, 0.0);
    else gw = zeros(e.weight.shape(), e.weight.dtype(), e.weight.device());
    e.weight.set_grad(gw);
  }
  RowExchange::add_locally(gw, idx, g);
}
nn::Embedding::RowGradSink local_row_sink(nn::Embedding* e) {
  return [e](const Tensor& idx, const Tensor& g) { add_rows_to_grad(*e, idx, g); };
}
}  // namespace

std::set<const Storage*> embedding_weight_storages(nn::Module& model) {
  std::set<const Storage*> out;
  for (const auto& [path, m] : model.named_modules())
    if (auto* e = dynamic_cast<nn::Embedding*>(m)) out.insert(e->weight.storage().get());
  return out;
}

std::vector<nn::Embedding*> row_sparse_embeddings(nn::Module& model) {
  std::vector<nn::Embedding*> out;
  for (auto& [name, m] : model.named_modules())
    if (auto* e = dynamic_cast<nn::Embedding*>(m); e && e->row_sparse_grad()) out.push_back(e);
  return out;
}

Strategy::Strategy(nn::Module& model, std::shared_ptr<ProcessGroup> pg, StrategyConfig config,
                   OptimizerConfig oc)
    : model_(model), pg_(std::move(pg)), config_(std::move(config)) {
  const int world = pg_ ? pg_->size() : 1;
  BLU_CHECK(config_.zero >= 0 && config_.zero <= 3, "--zero must be 0, 1, 2 or 3, got ", config_.zero);
  BLU_CHECK(config_.zero == 0 || pg_, "--zero ", config_.zero,
            " shards over a process group's ranks: it needs one (--dp > 1, or a group of one rank)");
  BLU_CHECK(config_.zero == 0 || oc.name == "adamw", "--zero ", config_.zero, " is implemented for adamw, got --optimizer ",
            oc.name);
  BLU_CHECK(oc.name == "adamw" || oc.name == "sgd", "--optimizer must be adamw or sgd, got '", oc.name, "'");
  BLU_CHECK(!config_.offload_state || oc.name == "adamw", "optimizer state offload is implemented for adamw, got ",
            "--optimizer ", oc.name);
  BLU_CHECK(!config_.offload_state || config_.zero == 0 || config_.offload.update == offload::UpdateOn::device,
            "optimizer state offload with --zero ", config_.zero, " streams the moments through the device: ",
            "--offload-update gpu, got ", offload::update_name(config_.offload.update));
  BLU_CHECK(!config_.offload.masters_on_host || (config_.offload_state && config_.zero == 0 && !config_.tp),
            "fp32 masters on the host (--offload-state master) need the host-run offloaded AdamW without ZeRO or ",
            "tensor parallelism; got --zero ", config_.zero, config_.tp ? " with tensor parallelism" : "");
  BLU_CHECK(!config_.offload.grads_on_host || (config_.offload.masters_on_host && world == 1 &&
                                               !config_.fp16_loss_scaling && !config_.skip_comm),
            "gradients on the host (--offload-state master+grads) go there as the backward makes them: they need ",
            "the masters on the host, one rank (data parallelism reduces gradients on the device) and no fp16 loss ",
            "scaling (it unscales them on the device); got ", world, " ranks",
            config_.fp16_loss_scaling ? " with fp16 loss scaling" : "");
  BLU_CHECK(!config_.skip_comm || (world > 1 && config_.zero == 0), "--skip-comm needs --dp > 1 without --zero");
  BLU_CHECK(!config_.split_masters || (oc.name == "adamw" && config_.zero == 0 && !config_.offload_state && !config_.tp),
            "split master weights (--master-weights split) are updated by AdamW's own kernel: they need --optimizer ",
            "adamw without --zero, state offload or tensor parallelism; got --optimizer ", oc.name, ", --zero ",
            config_.zero, config_.offload_state ? ", state offload" : "", config_.tp ? ", tensor parallelism" : "");
  BLU_CHECK(!config_.tp || config_.zero == 0, "tensor parallelism with --zero ", config_.zero,
            " is not implemented (ZeRO shards the data-parallel group's optimizer state of unsharded models)");
  BLU_CHECK(config_.batch_share >= 0 && config_.batch_share <= 1, "batch_share must be in [0, 1], got ",
            config_.batch_share);
  if (config_.batch_share > 0) share_factor_ = config_.batch_share * double(world);
  name_ = !pg_ ? "single" : config_.zero == 0 ? "ddp" : "zero" + std::to_string(config_.zero);
  if (config_.tp) name_ = pg_ ? name_ + "+tp" : "tp";
  if (config_.tp) {
    for (const ShardedParameter& s : sharded_parameters(model_)) {
      (s.info.sharded() ? tp_sharded_ : tp_replicated_).push_back(s.param);
      if (s.info.partial_grad) tp_partial_.push_back(s.param);
    }
  }
  if (config_.fp16_loss_scaling) scaler_ = std::make_unique<optim::LossScaler>();

  auto* lm = dynamic_cast<models::CausalLM*>(&model_);
  BLU_CHECK(config_.zero != 3 || lm, "--zero 3 gathers parameters block by block: it needs a models::CausalLM");
  if (config_.zero == 3) {
    // The shards are cut from rank 0's weights; each forward casts the gathered parameters afresh
    // (kept compute copies would hold every parameter whole).
    broadcast_parameters(model_, *pg_);
    model_.set_compute_copies(false);
  }
  const std::vector<nn::Embedding*> rows =
      config_.row_exchange && config_.zero != 3 ? row_sparse_embeddings(model_) : std::vector<nn::Embedding*>{};
  auto groups = optim::decay_groups(model_.named_parameters(), oc.weight_decay);
  if (oc.name == "adamw") {
    optim::AdamWOptions a{.lr = oc.lr, .beta1 = oc.beta1, .beta2 = oc.beta2, .eps = oc.eps, .state_dtype = oc.state_dtype};
    if (config_.zero > 0) {
      // Stage 2: a row-sparse embedding in a bucket alone — its dense part reduced first and its
      // rows exchanged at the end (row exchange), or its whole gradient complete only at the end.
      nn::Embedding* tied = rows.empty() ? nullptr : rows.front();
      ZeroOptions zo = zero_options_for(model_, config_.zero_bucket_mib, tied, config_.zero == 2 && config_.row_exchange);
      zo.rows_gather_limit = config_.rows_gather_limit;
      if (config_.offload_state) zo.offload_chunk_elements = config_.offload.chunk_elements;
      if (config_.zero == 3) {  // a unit per block, by the parameters' global names
        for (const models::BlockRef& b : lm->blocks()) {
          zo.units.emplace_back();
          for (const auto& [name, t] : b.module->named_parameters()) zo.units.back().push_back(b.name + "." + name);
        }
        zo.keep_forward = config_.zero3_keep_forward;
      }
      auto z = std::make_unique<ZeroAdamW>(std::move(groups), a, pg_, config_.zero, std::move(zo));
      zero_ = z.get();
      opt_ = std::move(z);
    } else if (config_.offload_state) {  // under tensor parallelism: this rank's shards and replicas
      opt_ = std::make_unique<offload::OffloadAdamW>(std::move(groups), a, config_.offload);
    } else {
      opt_ = optim::make_adamw(std::move(groups), a);
    }
  } else {
    opt_ = optim::make_sgd(std::move(groups), optim::SGDOptions{.lr = oc.lr, .momentum = oc.momentum});
  }
  opt_->attach_compute_copies(model_.compute_copies());  // the update writes them (bf16/fp16 runs)

  if (pg_) {  // rank 0's weights everywhere; ZeRO-2 reduces gradients itself, the others through DDP
    if (config_.zero == 2) {
      broadcast_parameters(model_, *pg_);
    } else if (config_.zero == 3) {
      ZeroAdamW* z = zero_;
      block_hooks_ = lm->add_block_hooks([z](size_t i, const Tensor& x) { return z->before_block(i, x); },
                                         [z](size_t i, const Tensor& y) { return z->after_block(i, y); });
    } else {
      DDPOptions d = config_.ddp;
      // BLU_DDP_REDUCE_DTYPE=bf16: the gradient buckets travel in bf16 (DDPOptions::reduce_dtype).
      if (const char* e = std::getenv("BLU_DDP_REDUCE_DTYPE"); !d.reduce_dtype && e && *e) d.reduce_dtype = dtype_from_name(e);
      d.exchange_rows = rows;
      d.rows_gather_limit = config_.rows_gather_limit;
      ddp_ = std::make_unique<DistributedDataParallel>(model_, pg_, d);
      if (config_.skip_comm) ddp_->set_sync(false);
    }
  }
  if (!pg_ && !config_.tp && !config_.offload.grads_on_host)  // Note [Tied rows on one device]
    for (nn::Embedding* e : rows) {
      if (e->has_row_grad_sink()) continue;
      e->set_row_grad_sink(local_row_sink(e));
      local_rows_.push_back(e);
    }
  params_ = model_.parameters();
  if (config_.offload_state && config_.offload.masters_on_host) release_masters();  // after DDP's broadcast
  else lay_out_compute_copies();  // after DDP's broadcast, whose writes would make them re-cast
  if (config_.split_masters) split_masters();
  if (config_.offload_state && config_.zero == 0 && config_.offload.update == offload::UpdateOn::cpu &&
      config_.offload.overlap_forward && !config_.offload.grads_on_host && lm) {
    // Note [Update behind the forward] (offload/offload_adamw.h): each block's forward waits for
    // its parameters' update; the first backward of a step for the whole update. Not with the
    // gradients on the host, whose own host work it slowed (docs/offload.md).
    offload_ = dynamic_cast<offload::OffloadAdamW*>(opt_.get());
    BLU_ASSERT(offload_, "optimizer state offload without the offloaded AdamW");
    std::vector<std::vector<std::string>> blocks;
    for (const models::BlockRef& b : lm->blocks()) {
      blocks.emplace_back();
      for (const auto& [name, t] : b.module->named_parameters()) blocks.back().push_back(b.name + "." + name);
    }
    offload_->overlap_with_forward(blocks);
    offload::OffloadAdamW* o = offload_;
    block_hooks_ = lm->add_block_hooks(
        [o](size_t i, const Tensor& x) {
          o->wait_block(i);
          return x;
        },
        [](size_t, const Tensor& y) { return y; });
  }
  tag_parameters(model_);
}

namespace {
// One token's forward in eval mode (no dropout draws from the generator), without autograd: what
// makes the compute copy of every parameter a forward reads (the two notes below).
void forward_one_token(models::CausalLM& lm, Device device) {
  NoGradGuard no_grad;
  const bool training = lm.is_training();
  lm.eval();
  lm.forward(zeros({1, 1}, DType::i64, device));
  lm.train(training);
}
}  // namespace

// Note [Compute copies laid out first]
// A 16-bit run's compute copies (Note [Compute copies], nn/compute_copy.h) are made by the first
// forward, each as its parameter is first read, between that forward's activations in the caching
// allocator's segments. They live for the whole run, so each segment they share with activations
// stays reserved once the activations are gone: on llama-250m at B=8 in 0.6× of torch.compile's
// memory, 30 segments of 44 and 88 MiB (the SwiGLU's buffers) each held a 2–62 MiB copy and 1.5
// GiB of free cache that no later request took (the run reserved 6.4 GiB for a 4.8 GiB peak).
// One token's forward in eval mode (no dropout draws: the step's random stream is untouched) at
// set-up makes every copy the model reads before any activation of a real batch exists, so the
// copies sit together and the first step's activation segments are freed whole. The copies are
// the cast kernel's, as the first step would make them: the same bits. Not where that forward
// would gather (ZeRO-3) or communicate (tensor parallelism), and not with the masters on the host,
// whose own one-token forward (release_masters, below) does the same.
void Strategy::lay_out_compute_copies() {
  auto* lm = dynamic_cast<models::CausalLM*>(&model_);
  if (!lm || params_.empty() || config_.tp || config_.zero == 3 || !model_.compute_copies_enabled() ||
      lm->compute_dtype() == params_.front().dtype())
    return;
  forward_one_token(*lm, params_.front().device());
}

// Note [Masters on the host] (offload/offload_adamw.h). One token's forward, in eval mode (no
// dropout draws from the generator), makes the compute copy of every parameter read through one;
// those that are no embedding's weight (looked up in their own dtype) leave the device.
void Strategy::release_masters() {
  auto* lm = dynamic_cast<models::CausalLM*>(&model_);
  BLU_CHECK(lm, "fp32 masters on the host: the model must be a models::CausalLM (its forward makes the compute copies)");
  masters_ = dynamic_cast<offload::OffloadAdamW*>(opt_.get());
  BLU_ASSERT(masters_, "fp32 masters on the host without the offloaded AdamW");
  const std::set<const Storage*> looked_up = embedding_weight_storages(model_);
  forward_one_token(*lm, params_.front().device());
  released_elements_ = masters_->release_parameters(
      [&](const std::string&, const Tensor& p) { return !looked_up.count(p.storage().get()); });
  BLU_CHECK(released_elements_ > 0, "fp32 masters on the host: no parameter is read through a 16-bit compute copy ",
            "(--precision bf16 or fp16 makes them), so every fp32 parameter would stay on the device");
}

// Note [Split masters] (optim/master_split.h), after the compute copies were laid out: every
// parameter read through a bf16 copy but no embedding's weight (looked up in fp32) is split.
void Strategy::split_masters() {
  auto* lm = dynamic_cast<models::CausalLM*>(&model_);
  BLU_CHECK(lm && !params_.empty() && model_.compute_copies_enabled() && lm->compute_dtype() == DType::bf16 &&
                params_.front().dtype() == DType::f32,
            "split master weights (--master-weights split) hold fp32 masters beside their bf16 compute copies: they ",
            "need a models::CausalLM trained in bf16 (--precision bf16)");
  const std::set<const Storage*> looked_up = embedding_weight_storages(model_);
  split_ = std::make_shared<optim::SplitMasters>(
      model_.named_parameters(), model_.compute_copies(),
      [&](const std::string&, const Tensor& p) { return !looked_up.count(p.storage().get()); });
  BLU_CHECK(split_->elements() > 0, "split master weights: no parameter is read through a bf16 compute copy");
  opt_->attach_split_masters(split_);
}

Strategy::Strategy(models::CausalLM& model, std::shared_ptr<ProcessGroup> pp, PipelineOptions pipeline,
                   StrategyConfig config, OptimizerConfig oc)
    : model_(model), pg_(std::move(pp)), config_(std::move(config)) {
  BLU_CHECK(config_.zero == 0, "pipeline parallelism: --zero ", config_.zero, " is not supported with a pipeline");
  BLU_CHECK(!config_.split_masters, "pipeline parallelism: split master weights (--master-weights split) are not ",
            "supported with a pipeline");
  BLU_CHECK(!config_.fp16_loss_scaling, "pipeline parallelism: fp16 loss scaling is not supported with a pipeline");
  BLU_CHECK(!config_.offload_state || (oc.name == "adamw" && !config_.offload.masters_on_host),
            "pipeline parallelism: optimizer state offload is implemented for adamw's state alone (--optimizer adamw, ",
            "--offload-state optimizer)");
  BLU_CHECK(oc.name == "adamw" || oc.name == "sgd", "--optimizer must be adamw or sgd, got '", oc.name, "'");
  BLU_CHECK(config_.batch_share >= 0 && config_.batch_share <= 1, "batch_share must be in [0, 1], got ",
            config_.batch_share);
  const int replicas = config_.dp ? config_.dp->size() : 1;
  if (config_.batch_share > 0) share_factor_ = config_.batch_share * double(replicas);
  name_ = "pipeline";
  pipeline.tp = config_.tp;
  if (replicas > 1 || share_factor_ != 1.0) {
    // The replicas' average of the owned gradients, each weighted by its replica's share of the rows.
    pipeline.reduce_gradients = [this, replicas] {
      NoGradGuard no_grad;
      std::vector<Tensor> grads;
      for (const auto& [name, p] : pipeline_->owned_parameters())
        if (p.grad().defined()) grads.push_back(p.grad());
      if (share_factor_ != 1.0)
        for (Tensor& g : grads) mul_(g, share_factor_);
      if (replicas == 1) return;
      all_reduce_packed(*config_.dp, grads, ReduceOp::avg);
    };
  }
  pipeline_ = std::make_unique<PipelineStage>(model, pg_, std::move(pipeline));
  if (config_.job) pg_ = config_.job;
  auto groups = optim::decay_groups(pipeline_->owned_parameters(), oc.weight_decay);
  const optim::AdamWOptions a{
      .lr = oc.lr, .beta1 = oc.beta1, .beta2 = oc.beta2, .eps = oc.eps, .state_dtype = oc.state_dtype};
  if (config_.offload_state) {  // the state of the parameters this stage owns
    opt_ = std::make_unique<offload::OffloadAdamW>(std::move(groups), a, config_.offload);
  } else if (oc.name == "adamw") {
    opt_ = optim::make_adamw(std::move(groups), a);
  } else {
    opt_ = optim::make_sgd(std::move(groups), optim::SGDOptions{.lr = oc.lr, .momentum = oc.momentum});
  }
  opt_->attach_compute_copies(model_.compute_copies());
  for (const auto& [name, p] : pipeline_->owned_parameters()) params_.push_back(p);
  tag_parameters(model_);
}


Strategy::~Strategy() {
  if (block_hooks_ >= 0) dynamic_cast<models::CausalLM&>(model_).remove_block_hooks(block_hooks_);
  for (nn::Embedding* e : local_rows_) e->set_row_grad_sink({});  // its gradient flows into the weight again
}

void Strategy::finish_update() {
  if (offload_) offload_->finish_update();
}

Strategy::FullParameters::FullParameters(Strategy& s) : zero_(s.zero_), pipeline_(s.pipeline_.get()) {
  s.finish_update();
  if (zero_) zero_->gather_full();
  if (pipeline_) pipeline_->share_parameters();
}

Strategy::FullParameters::~FullParameters() {
  if (zero_) zero_->release_full();
  if (pipeline_) pipeline_->release_parameters();
}

int Strategy::rank() const { return pg_ ? pg_->rank() : 0; }
int Strategy::world_size() const { return pg_ ? pg_->size() : 1; }

std::string Strategy::describe() const {
  if (pipeline_) {
    std::string s = pipeline_->describe() + (pg_ ? " (" + pg_->backend() + ")" : std::string());
    if (config_.tp) s += ", each stage tensor parallel over " + std::to_string(config_.tp->size()) + " ranks";
    if (config_.dp) s += ", " + std::to_string(config_.dp->size()) + " replicas averaging gradients";
    return s;
  }
  const std::string tp = config_.tp ? "tensor parallel over " + std::to_string(config_.tp->size()) + " ranks (" +
                                          config_.tp->backend() + ")"
                                    : "";
  if (!pg_) return config_.tp ? tp : "single device";
  std::string s = std::to_string(pg_->size()) + " ranks (" + pg_->backend() + "), ";
  s += config_.zero > 0 ? "ZeRO stage " + std::to_string(config_.zero) : std::string("DDP all-reduce");
  if (config_.zero == 3 && config_.zero3_keep_forward) s += " (blocks kept from forward to backward)";
  return config_.tp ? s + ", " + tp : s;
}

StepValues Strategy::step(int64_t n, const std::function<Tensor(int64_t)>& loss_of, double lr, double max_norm,
                          const std::function<void(int)>& phase) {
  const auto mark = [&](int i) {
    if (phase) phase(i);
  };
  BLU_CHECK(n >= 1, "Strategy::step: expected at least one micro-batch, got ", n);
  BLU_CHECK(!pipeline_, "Strategy::step: a pipeline runs its stages from batches: call step(n, batch_of, …)");
  StepValues v;
  v.micro_batches = n;
  v.lr = lr;
  opt_->zero_grad();
  if (masters_ && config_.offload.grads_on_host) masters_->zero_host_gradients();
  // Note [Tied rows on one device]: one micro-batch only; with several, autograd's sum of each
  // micro-batch's two gradients before the accumulation is the plain loop's association.
  for (nn::Embedding* e : local_rows_) e->set_row_grad_sink(n == 1 ? local_row_sink(e) : nn::Embedding::RowGradSink());
  for (int64_t micro = 0; micro < n; ++micro) {
    const bool last = micro + 1 == n;
    // Only the last micro-batch's backward communicates.
    std::optional<DistributedDataParallel::NoSync> no_sync;
    if (ddp_ && !last) no_sync.emplace(*ddp_);
    if (zero_ && zero_->stage() == 2) zero_->set_sync(last);
    const bool zero3 = zero_ && zero_->stage() == 3;
    if (zero3) zero_->begin_forward(micro == 0);
    const Tensor loss = loss_of(micro);
    BLU_CHECK(loss.defined() && loss.numel() == 1, "Strategy::step: micro-batch ", micro,
              " returned no scalar loss (got ", loss.defined() ? loss.str() : std::string("undefined"), ")");
    {
      NoGradGuard no_grad;
      Tensor l = to_dtype(loss.detach(), DType::f64);
      if (share_factor_ != 1.0) l = mul(l, share_factor_);
      v.loss_sum = micro == 0 ? l : add(v.loss_sum, l);
    }
    // Gradients of the mean over all micro-batches (and of the fp16 loss scale, a device value),
    // weighted by this replica's share of the rows.
    if (zero3) zero_->begin_backward();
    if (micro == 0) finish_update();  // the backward's gradients never meet the last update's copies
    if (scaler_) {
      mul(loss, mul(scaler_->scale_tensor(loss.device()), share_factor_ / double(n))).backward();
    } else {
      const double factor = share_factor_ / double(n);
      (factor != 1.0 ? mul(loss, factor) : loss).backward();
    }
    if (zero3) zero_->end_backward();  // ZeRO-3 reduces every micro-batch: no unit keeps its gradient
  }
  // DDP first: the averaged gradients are the same on every rank, so unscaling and the overflow
  // check agree everywhere, and nothing touches a bucket while its all-reduce may still run.
  mark(1);
  if (ddp_) ddp_->finish();
  if (zero_) zero_->reduce_gradients();  // ZeRO-2: its reduce-scatters, issued during backward
  if (config_.tp) {  // sequence parallelism's partial gradients: each rank saw its sequence shard
    NoGradGuard no_grad;
    std::vector<Tensor> grads;
    for (const Tensor& p : tp_partial_)
      if (p.grad().defined()) grads.push_back(p.grad());
    all_reduce_packed(*config_.tp, grads, ReduceOp::sum);
  }
  mark(2);
  // fp16: the gradients unscaled on the device; an overflow shows as a non-finite norm, so the gated
  // update skips it and the scaler backs off (LossScaler::update), with no host read. DDP's averaged
  // gradients, and ZeRO-2's all-reduced shard total, give every rank the same decision.
  if (scaler_) {
    std::vector<Tensor> grads;
    if (zero_ && zero_->stage() >= 2) {
      grads.push_back(zero_->shard_gradient());
    } else {
      for (const Tensor& p : params_) grads.push_back(p.grad());
    }
    scaler_->unscale(grads);
  }
  const double clip = max_norm > 0 ? max_norm : std::numeric_limits<double>::infinity();
  v.gate = zero_                                     ? zero_->norm_gate(clip)
           : config_.tp                                ? tp_norm_gate(clip)
           : masters_ && config_.offload.grads_on_host ? host_gradients_gate(clip)
                                                       : optim::grad_norm_gate(params_, clip);
  opt_->set_lr(lr);
  opt_->step(v.gate);
  if (scaler_) {
    NoGradGuard no_grad;
    scaler_->update(v.gate.sum_squares);
    v.fp16_skipped = scaler_->skipped_tensor();
  }
  mark(3);
  return v;
}

StepValues Strategy::step(int64_t n, const BatchFn& batch_of, double lr, double max_norm,
                          const std::function<void(int)>& phase) {
  if (!pipeline_) {
    auto* lm = dynamic_cast<models::CausalLM*>(&model_);
    BLU_CHECK(lm, "Strategy::step with batches needs a models::CausalLM (use the loss-callback step otherwise)");
    return step(n, [&](int64_t i) {
      const auto [idx, targets] = batch_of(i);
      return lm->forward(idx, targets).loss;
    }, lr, max_norm, phase);
  }
  BLU_CHECK(n >= 1, "Strategy::step: expected at least one micro-batch, got ", n);
  const auto mark = [&](int i) {
    if (phase) phase(i);
  };
  StepValues v;
  v.micro_batches = n;
  v.lr = lr;
  opt_->zero_grad();
  const PipelineStepValues pv = pipeline_->forward_backward(n, batch_of, max_norm);
  mark(1);
  mark(2);  // the gradients are complete (the tied weight's parts summed) when forward_backward returns
  v.loss_sum = share_factor_ != 1.0 ? mul(pv.loss_sum, share_factor_) : pv.loss_sum;
  v.gate = pv.gate;
  opt_->set_lr(lr);
  opt_->step(v.gate);
  mark(3);
  return v;
}

// The global norm's square: the shards' squares summed over the TP group, plus the replicated
// parameters' once (they are the same on every rank of the group).
// Gradients on the host (Note [Gradients on the host]): the released parameters' squares summed
// by the host, in double, added to the device's sum over the resident parameters' gradients.
NormGate Strategy::host_gradients_gate(double max_norm) {
  NoGradGuard no_grad;
  const double host = masters_->finish_host_gradients();
  NormGate gate = optim::grad_norm_gate(params_, max_norm);
  const Tensor h = full({1}, host, DType::f64, params_.front().device());
  gate.sum_squares = gate.defined() ? add(to_dtype(reshape(gate.sum_squares, {1}), DType::f64), h) : h;
  gate.max_norm = max_norm;
  return gate;
}

NormGate Strategy::tp_norm_gate(double max_norm) {
  NoGradGuard no_grad;
  auto squares = [](const std::vector<Tensor>& params) {
    std::vector<Tensor> grads;
    for (const Tensor& p : params)
      if (p.grad().defined()) grads.push_back(p.grad());
    return grads.empty() ? Tensor() : sum_squares(grads);
  };
  Tensor sharded = squares(tp_sharded_), replicated = squares(tp_replicated_);
  NormGate gate;
  gate.max_norm = max_norm;
  if (sharded.defined()) {
    sharded = clone(reshape(sharded, {1}));
    config_.tp->all_reduce(sharded, ReduceOp::sum)->wait();
    sharded = reshape(sharded, {});
  }
  gate.sum_squares = !sharded.defined() ? replicated : !replicated.defined() ? sharded : add(sharded, replicated);
  return gate;
}

StepReadout Strategy::read(const StepValues& v, bool stop_requested) {
  NoGradGuard no_grad;
  const Device dev = v.loss_sum.device();
  // [loss_sum, stop] (summed over ranks first), then the gradient norm's square: one read.
  std::vector<Tensor> parts{reshape(v.loss_sum, {1})};
  if (pg_) {
    Tensor flag = from_vector({stop_requested ? 1.0 : 0.0}, {1}, DType::f64);
    if (dev != kCPU) flag = to_device(flag, dev);  // a GPU, or a device pool cpu:N
    Tensor t = cat({parts[0], flag}, 0);
    pg_->all_reduce(t, ReduceOp::sum)->wait();
    parts = {t};
  }
  const bool has_skipped = v.fp16_skipped.defined();
  if (has_skipped) parts.push_back(reshape(v.fp16_skipped, {1}));
  const bool has_norm = v.gate.sum_squares.defined();
  if (has_norm) parts.push_back(reshape(to_dtype(v.gate.sum_squares, DType::f64), {1}));
  const std::vector<double> got = to_vector(parts.size() == 1 ? parts[0] : cat(parts, 0));
  StepReadout r;
  const int world = pg_ ? pg_->size() : 1;
  // A pipeline's loss is on its last stage alone (the others add zero): on the last stage's ranks
  // of every replica and TP rank.
  const int loss_ranks = pipeline_ ? world / pipeline_->stages() : world;
  r.loss = got[0] / double(v.micro_batches * loss_ranks);
  r.stop = pg_ ? got[1] > 0 : stop_requested;
  r.grad_norm = has_norm ? std::sqrt(got.back()) : 0.0;
  if (has_skipped) r.fp16_skipped = int64_t(got[got.size() - (has_norm ? 2 : 1)]);
  return r;
}

double Strategy::mean_over_ranks(double v) {
  if (!pg_) return v;
  Tensor t = full({1}, v, DType::f64, pg_->backend() == "nccl" ? params_[0].device() : kCPU);
  pg_->all_reduce(t, ReduceOp::avg)->wait();
  return host_value(t);
}

void Strategy::barrier() {
  if (pg_) pg_->barrier()->wait();
}

std::string Strategy::save(const std::string& dir, const nn::Module& model, const TrainState& st, int keep_last) {
  const auto values = parameter_values();  // fp32 masters on the host: written from there
  if (config_.tp || zero_ || pipeline_ || config_.layout_checkpoints) {
    const CheckpointRanks ranks = checkpoint_ranks();
    std::vector<GlobalPiece> pieces;
    if (zero_) {
      pieces = zero_pieces(*zero_, ranks.file_rank == 0);
    } else {
      pieces = held_pieces(held_parameters(), opt_->state(), ranks.file_rank == 0);
    }
    return save_layout_checkpoint(dir, ranks, pieces, st, layout_json(), keep_last);
  }
  if (rank() == 0) return save_checkpoint(dir, model, opt_.get(), st, keep_last);
  return "";  // the model is replicated: rank 0's file is the checkpoint
}

TrainState Strategy::load(const std::string& path, nn::Module& model, const nlohmann::json& expected_model_config) {
  const auto values = parameter_values();  // fp32 masters on the host: loaded there, then re-cast
  // A layout's own older format through its own loader; everything else by global names.
  const std::string format = describe_checkpoint_format(path);
  if (pipeline_ && format.starts_with("pipeline")) return pipeline_->load(path, *opt_, expected_model_config);
  if (zero_ && format.starts_with("ZeRO")) return load_sharded_checkpoint(path, model, *zero_, expected_model_config);
  if (!pipeline_ && !zero_ && !config_.tp && format.starts_with("single-file"))
    return load_checkpoint(path, model, opt_.get(), expected_model_config);
  const LayoutCheckpoint ck(path, expected_model_config);
  if (zero_) ck.load_zero(*zero_);
  else ck.load_held(held_parameters(), opt_.get());
  return ck.train_state();
}

std::string Strategy::latest_checkpoint(const std::string& dir, const CheckpointWarning& warn) const {
  return latest_any_checkpoint(dir, warn);
}

CheckpointRanks Strategy::checkpoint_ranks() const {
  CheckpointRanks r;
  const int tp = config_.tp && !config_.job ? config_.tp->size() : 1,
            tp_rank = config_.tp && !config_.job ? config_.tp->rank() : 0;
  // pg_ is the job's group under a hybrid pipeline (config_.job), else this layout's group (the
  // data-parallel one beside a TP group, or the pipeline's); the TP group completes the job.
  r.file_rank = rank() * tp + tp_rank;
  r.files = world_size() * tp;
  ProcessGroup *pg = pg_.get(), *tpg = config_.tp && !config_.job ? config_.tp.get() : nullptr;
  // Summed over pg, then the TP group: the total over every rank of the job.
  if (pg || tpg) {
    const Device dev = (pg ? pg : tpg)->backend() == "nccl" ? params_.front().device() : kCPU;
    r.count_failed = [pg, tpg, dev](bool failed) {
      Tensor flag = full({1}, failed ? 1.0 : 0.0, DType::f64, dev);
      for (ProcessGroup* g : {pg, tpg})
        if (g) g->all_reduce(flag, ReduceOp::sum)->wait();
      return int(std::llround(host_value(flag)));
    };
  }
  return r;
}

std::vector<HeldParameter> Strategy::held_parameters() {
  // Every global tensor written once: by the first replica only (dp rank 0), within it a sharded
  // parameter by each TP rank (its boxes) and a replicated one by one TP rank in turn, and under a
  // pipeline by the lowest stage that trains it (a tied weight by the first). Plain data
  // parallelism spreads the replicated parameters over all ranks instead.
  std::map<std::string, ShardInfo> shards;
  if (config_.tp)
    for (const ShardedParameter& sp : sharded_parameters(model_)) shards.emplace(sp.name, sp.info);
  const int tp = config_.tp ? config_.tp->size() : 1, tp_rank = config_.tp ? config_.tp->rank() : 0;
  const auto held = [&](const std::string& name, const Tensor& p, bool write_whole, size_t& turn) {
    const auto it = shards.find(name);
    if (it == shards.end()) return HeldParameter{name, p, p.shape(), -1, {}, write_whole};
    const ShardInfo& info = it->second;
    HeldParameter h{name, p, info.full_shape, info.dim, info.ranges(), write_whole};
    if (!info.sharded()) h.write = write_whole && int(turn++ % size_t(tp)) == tp_rank;
    return h;
  };
  std::vector<HeldParameter> out;
  size_t turn = 0;
  if (pipeline_) {
    const nn::NamedTensors all = model_.named_parameters();
    std::set<std::string> mine;
    for (const auto& [name, p] : pipeline_->owned_parameters()) mine.insert(name);
    const int P = pipeline_->stages(), stage = pipeline_->rank();
    std::vector<double> v;
    for (const auto& [name, p] : all) v.push_back(mine.count(name) ? double(P - stage) : 0.0);
    if (pg_) {  // the pipeline's group or the job's: either holds every stage
      Tensor t = from_vector(v, {int64_t(v.size())}, DType::f64);
      if (pg_->backend() == "nccl") t = to_device(t, all.front().second.device());
      pg_->all_reduce(t, ReduceOp::max)->wait();
      v = to_vector(t);
    }
    std::map<std::string, int> first;
    for (size_t i = 0; i < all.size(); ++i) first[all[i].first] = P - int(v[i]);
    const bool first_replica = !config_.dp || config_.dp->rank() == 0;
    for (const auto& [name, p] : pipeline_->owned_parameters())
      out.push_back(held(name, p, first_replica && first.at(name) == stage, turn));
    return out;
  }
  if (config_.tp) {
    for (const auto& [name, p] : model_.named_parameters()) out.push_back(held(name, p, rank() == 0, turn));
    return out;
  }
  const CheckpointRanks ranks = checkpoint_ranks();
  size_t i = 0;  // replicated: parameter i by file rank i mod files
  for (const auto& [name, p] : model_.named_parameters())
    out.push_back({name, p, p.shape(), -1, {}, int(i++ % size_t(ranks.files)) == ranks.file_rank});
  return out;
}

nlohmann::json Strategy::layout_json() const {
  return {{"name", name_},
          {"describe", describe()},
          {"ranks", checkpoint_ranks().files},
          {"tp", config_.tp ? config_.tp->size() : 1},
          {"pp", pipeline_ ? pipeline_->stages() : 1},
          {"dp", pipeline_ ? (config_.dp ? config_.dp->size() : 1) : world_size()},
          {"zero", config_.zero}};
}

std::string Strategy::checkpoint_kind() const {
  if (config_.tp || zero_ || pipeline_ || config_.layout_checkpoints)
    return "committed layout checkpoint (ckpt_*/COMMIT, pieces of global tensors)";
  return "checkpoint (ckpt_*.safetensors)";
}

}  // namespace blu::dist
