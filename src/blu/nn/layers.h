// nn/layers: the basic modules GPT-2 is made of — Linear, Embedding, LayerNorm, Dropout — and
// ModuleList, a numbered container ("h.0", "h.1", …). Each forward is one dispatched op (linear,
// embedding, layer_norm, dropout), so the modules add names and state, never math.
// Depends on nn/module, ops/. Keep: constructors allocate parameters with fixed values (Linear
// and Embedding weights zero, LayerNorm weight one, biases zero); the owning model initialises
// them (GPT: GPT-2's init) — call init_normal_ for a stand-alone layer. Linear weights are
// [out, in], as torch.nn.Linear.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blu/core/rng.h"
#include "blu/nn/module.h"

namespace blu::nn {

// Fills w (in place, no autograd) with normal(0, std) drawn from gen.
void init_normal_(const Tensor& w, double std, Generator& gen);

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  // Virtual for the sharded linears of tensor parallelism (dist/tensor_parallel.h), which add
  // their collectives around the GEMM.
  virtual Tensor forward(const Tensor& x) const;  // x [..., in] → [..., out]
  // residual + forward(x) in one GEMM (ops/linalg.h: linear's residual); residual [..., out].
  virtual Tensor forward(const Tensor& x, const Tensor& residual) const;
  // Whether a caller may fold this layer into a fused op by reading weight and bias itself
  // (GPT-2's MLP: gelu_linear): true when forward is exactly linear(x, weight, bias); a subclass
  // whose forward does more returns false.
  virtual bool fusable() const { return true; }
  int64_t in_features, out_features;
  Tensor weight;  // [out, in]
  Tensor bias;    // [out], undefined without bias
};

// Linears that read the same input (Llama's q/k/v projections, its gate and up): each one's
// forward(x), in order. When every one is fusable() and without bias, one GEMM over their weights
// concatenated along the output dim computes them all, and the outputs are views of its [..., Σ out]
// result (Note [Sibling linears], layers.cpp); otherwise each layer's own forward runs.
std::vector<Tensor> sibling_linears(const Tensor& x, const std::vector<const Linear*>& layers);
// The one GEMM's [..., Σ out] result itself, for a caller that reads the outputs as one buffer
// (Llama's q/k/v as [B, T, H + 2·Hkv, D] heads); undefined when the layers cannot be fused.
Tensor sibling_linears_joined(const Tensor& x, const std::vector<const Linear*>& layers);

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim);
  // idx (i32/i64, any shape) → [..., dim]. Virtual for the vocabulary-parallel embedding
  // (dist/tensor_parallel.h).
  virtual Tensor forward(const Tensor& idx) const;
  Tensor weight;  // [num_embeddings, dim]

  // Row sink: while one is set, a forward that records gradients hands backward's gradient of
  // its output ([idx..., dim], with the forward's idx) to the sink instead of adding it into
  // weight's gradient — weight then gets only the gradients of its other uses (a tied LM head).
  // The sink owns the rows: DDP exchanges them across ranks (DDPOptions::exchange_rows) and adds
  // them itself. An empty function removes the sink.
  using RowGradSink = std::function<void(const Tensor& idx, const Tensor& grad)>;
  void set_row_grad_sink(RowGradSink sink) { row_sink_ = std::move(sink); }
  bool has_row_grad_sink() const { return bool(row_sink_); }
  // Declares that a strategy may take this embedding's gradient as rows through the sink and
  // exchange them apart (dist/strategy.h; DDP's row exchange): what a model sets on a token
  // embedding tied to its LM head, whose dense head gradient is ready at the start of backward and
  // whose row gradient comes at the very end. Off by default.
  void set_row_sparse_grad(bool on) { row_sparse_grad_ = on; }
  bool row_sparse_grad() const { return row_sparse_grad_; }

 private:
  RowGradSink row_sink_;
  bool row_sparse_grad_ = false;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, bool bias = true, double eps = 1e-5);
  Tensor forward(const Tensor& x) const;  // normalises the last dim
  double eps;
  Tensor weight;  // [dim], ones
  Tensor bias;    // [dim], zeros; undefined without bias
};

// Active only while training (Module::train); draws its masks from `gen` (the default generator
// when null). `gen` must outlive the module.
class Dropout : public Module {
 public:
  explicit Dropout(double p, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) const;
  bool active() const { return is_training() && p != 0.0; }  // forward is not the identity
  double p;

 private:
  Generator* gen_;
};

// Submodules named "0", "1", … in the order they are added.
template <typename M>
class ModuleList : public Module {
 public:
  M& push_back(std::shared_ptr<M> m) {
    const size_t i = items_.size();
    items_.push_back(m);
    register_child(std::to_string(i), m, [this, i](const std::shared_ptr<Module>& r) {
      auto typed = std::dynamic_pointer_cast<M>(r);
      if (typed) items_[i] = typed;
      return bool(typed);
    });
    return *items_.back();
  }
  int64_t size() const { return int64_t(items_.size()); }
  M& operator[](int64_t i) const { return *items_.at(size_t(i)); }

 private:
  std::vector<std::shared_ptr<M>> items_;
};

}  // namespace blu::nn
