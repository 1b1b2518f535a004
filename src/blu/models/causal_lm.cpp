#include "blu/models/causal_lm.h"

#include <algorithm>
#include <cmath>

#include "blu/autograd/function.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::models {

void CausalLM::set_compute_dtype(DType dtype) {
  BLU_CHECK(is_floating(dtype), family(), ": compute dtype must be floating, got ", dtype);
  compute_dtype_ = dtype;
}

DType CausalLM::compute_dtype() const { return compute_dtype_.value_or(token_embedding().weight.dtype()); }

LMOutput CausalLM::forward(const Tensor& idx, const Tensor& targets) {
  Tensor x = embed(idx, 0);
  const size_t n = num_blocks();
  for (size_t i = 0; i < n; ++i) x = block(i, x);
  return head(x, targets);
}

Tensor CausalLM::forward_cached(const Tensor& idx, KVCache& cache) {
  const int64_t pos0 = cache.length();
  Tensor x = embed(idx, pos0);
  const size_t n = num_blocks();
  if (cache.k.empty()) cache.k.resize(n), cache.v.resize(n);
  BLU_CHECK(cache.k.size() == n && cache.v.size() == n, family(), ": the cache holds ", cache.k.size(),
            " layers, the model has ", n);
  for (size_t i = 0; i < n; ++i) x = block(i, x, pos0, &cache);
  const Tensor logits = head(x).logits;
  return sharded.gather_logits ? sharded.gather_logits(logits) : logits;  // tensor parallelism: the full vocabulary
}

void CausalLM::set_loss_chunks(int64_t chunks) {
  BLU_CHECK(chunks >= 0, family(), ": loss chunks must be >= 0 (0 or 1: the logits made whole), got ", chunks);
  BLU_CHECK(chunks <= 1 || !sharded.loss, family(), ": the loss in ", chunks,
            " row pieces is not supported under tensor parallelism (its vocabulary-parallel loss holds this rank's "
            "shard of the logits)");
  loss_chunks_ = chunks;
}

void CausalLM::set_activation_policy(const ActivationPolicy& policy) {
  const auto check = [&](const BlockSet& b, const char* what) {
    BLU_CHECK(b.every >= 0 && b.first >= 0 && (b.every == 0 || b.first == 0), family(), ": ", what,
              " recompute on every N-th block or on the first K: expected N >= 1 or K >= 1 (or both 0 for none), "
              "got N ",
              b.every, ", K ", b.first);
    BLU_CHECK(b.first <= int64_t(num_blocks()), family(), ": ", what, " recompute on the first ", b.first,
              " blocks, but the model has ", num_blocks());
  };
  check(policy.block, "block");
  check(policy.mlp, "MLP");
  activation_policy_ = policy;
  if (!policy.offload) offloader_.reset();
  else if (!offloader_) offloader_ = std::make_shared<ActivationOffloader>();
}

Tensor CausalLM::run_block_with_policy(size_t i, const Tensor& x, int64_t pos0) {
  const ActivationPolicy& p = activation_policy_;
  if (!p.any() || !GradMode::enabled()) return run_block(i, x, pos0, nullptr, nullptr);
  const BlockRef ref = blocks().at(i);
  // Open inside out: the recompute hook sees a dropped region output before the offloader does.
  std::optional<SavedTensorHooks> offload_hook;
  if (offloader_) offload_hook.emplace(offloader_->hook(i, *ref.module));
  Tensor y;
  if (p.recompute_block(i)) {
    y = checkpoint(
        ref.name, [this, i, pos0](const std::vector<Tensor>& in) { return run_block(i, in[0], pos0, nullptr, nullptr); },
        {x}, generators());
  } else if (p.selective || p.recompute_mlp(i)) {
    SavedTensorHooks recompute_hook(recompute_pack_hook());
    SelectiveScope scope(generators(), p.selective, p.recompute_mlp(i));
    y = run_block(i, x, pos0, nullptr, nullptr);
  } else {
    y = run_block(i, x, pos0, nullptr, nullptr);
  }
  if (!offloader_) return y;
  // Block i's backward comes next when the gradient reaches y: fetch block i (if nothing has
  // yet) and block i-1, so the copies run while block i's backward computes.
  std::weak_ptr<ActivationOffloader> off = offloader_;
  return identity_with_backward_callback(
      y,
      [off, i] {
        if (auto o = off.lock()) {
          o->prefetch(i);
          if (i > 0) o->prefetch(i - 1);
        }
      },
      "prefetch activations " + ref.name);
}

Tensor CausalLM::block(size_t i, const Tensor& x, int64_t pos0, KVCache* cache) {
  BLU_CHECK(!cache || (i < cache->k.size() && i < cache->v.size()), family(), ": block ", i,
            " has no slot in a cache of ", cache ? cache->k.size() : 0, " layers");
  if (hooks_.empty()) {
    return cache ? run_block(i, x, pos0, &cache->k[i], &cache->v[i]) : run_block_with_policy(i, x, pos0);
  }
  Tensor h = x;
  for (const Hooks& k : hooks_)
    if (k.before) h = k.before(i, h);
  Tensor y = cache ? run_block(i, h, pos0, &cache->k[i], &cache->v[i]) : run_block_with_policy(i, h, pos0);
  for (const Hooks& k : hooks_)
    if (k.after) y = k.after(i, y);
  return y;
}

int CausalLM::add_block_hooks(BlockHook before, BlockHook after) {
  hooks_.push_back({next_hook_, std::move(before), std::move(after)});
  return next_hook_++;
}

void CausalLM::remove_block_hooks(int handle) {
  const auto it = std::find_if(hooks_.begin(), hooks_.end(), [&](const Hooks& k) { return k.handle == handle; });
  BLU_CHECK(it != hooks_.end(), family(), ": no block hooks with handle ", handle);
  hooks_.erase(it);
}

namespace {

// Picks a token id from logits (already restricted to the real vocabulary).
int32_t sample_token(std::vector<double> logits, double temperature, int64_t top_k, Generator& gen) {
  const int64_t V = int64_t(logits.size());
  if (temperature <= 0.0 || top_k == 1) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());  // first maximum
  }
  if (top_k > 0 && top_k < V) {
    std::vector<double> sorted = logits;
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<>());
    const double kth = sorted[size_t(top_k - 1)];
    for (double& l : logits)
      if (l < kth) l = -INFINITY;
  }
  const double mx = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (double& l : logits) total += (l = std::exp((l - mx) / temperature));
  const double u = rand({1}, DType::f32, kCPU, &gen).item() * total;
  double acc = 0.0;
  int32_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (logits[size_t(i)] == 0.0) continue;
    acc += logits[size_t(i)];
    last = int32_t(i);
    if (u < acc) return last;
  }
  return last;  // rounding left u at the very top: the last token with non-zero probability
}

}  // namespace

std::vector<int32_t> CausalLM::generate(const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                                        double temperature, int64_t top_k, Generator& gen) {
  BLU_CHECK(!prompt.empty(), "generate: the prompt is empty (start with a token, e.g. <|endoftext|>)");
  BLU_CHECK(max_new_tokens >= 0 && top_k >= 0, "generate: expected max_new_tokens >= 0 and top_k >= 0, got ",
            max_new_tokens, " and ", top_k);
  const int64_t V = vocab_size(), max_len = max_seq_len();
  for (int32_t t : prompt) BLU_CHECK(t >= 0 && t < V, "generate: prompt token ", t, " is outside [0, ", V, ")");
  NoGradGuard no_grad;
  const bool was_training = is_training();
  eval();
  struct Restore {
    CausalLM* m;
    bool on;
    ~Restore() { m->train(on); }
  } restore{this, was_training};

  std::vector<int32_t> tokens = prompt;
  KVCache cache;
  const Device device = token_embedding().weight.device();
  auto ids = [&](const int32_t* p, int64_t n) {
    const Tensor host = from_vector(std::vector<double>(p, p + n), {1, n}, DType::i32);
    return device == kCPU ? host : to_device(host, device);  // the model's device (a GPU: one copy)
  };
  Tensor logits;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    const int64_t n = int64_t(tokens.size());
    if (step == 0 || cache.length() + 1 > max_len) {
      // (Re)fill the cache with the last max_len tokens in one causal pass.
      cache.clear();
      const int64_t m = std::min(n, max_len);
      logits = forward_cached(ids(tokens.data() + (n - m), m), cache);
    } else {
      logits = forward_cached(ids(&tokens.back(), 1), cache);
    }
    Tensor last = narrow(select(select(logits, 0, 0), 0, logits.size(1) - 1), 0, 0, V);
    tokens.push_back(sample_token(to_vector(last), temperature, top_k, gen));
  }
  return std::vector<int32_t>(tokens.begin() + int64_t(prompt.size()), tokens.end());
}

}  // namespace blu::models
