// A decoder written without hand fusion, for the compiler's GEMM epilogues (compiler/epilogue.h):
// an embedding, then per layer `x + linear(relu(linear(x, w1) + b1), w2, b2)` — a bias add after
// a GEMM without one, and a residual add after a GEMM — or, with `gelu`, `x + linear(gelu_tanh(
// linear(x, w1, b1)), w2, b2)` — a GELU after a GEMM with its bias — then a head and the loss; one
// SGD step per call. The compiled-step tests train it small on the CPU and the GPU; a GPU perf test times it at
// GPT-2's width.
#pragma once
#include <utility>
#include <vector>

#include "blu/blu.h"

namespace blu::test {

struct PlainDecoderSize {
  int64_t B = 2, T = 8, C = 16, V = 29, layers = 1;
  bool gelu = false;
};

struct PlainDecoder {
  using Size = PlainDecoderSize;
  Size n;
  Tensor emb, head;
  std::vector<Tensor> w1, b1, w2, b2;  // per layer: [4C, C], [4C], [C, 4C], [C]
  PlainDecoder(uint64_t seed, Device device, Size size = Size(), DType dtype = DType::f32) : n(size) {
    manual_seed(seed);
    auto param = [&](Shape shape, double scale) {
      return to_dtype(to_device(mul(randn(shape), scale), device), dtype);
    };
    emb = param({n.V, n.C}, 0.3);
    for (int64_t l = 0; l < n.layers; ++l) {
      w1.push_back(param({4 * n.C, n.C}, 0.3));
      b1.push_back(param({4 * n.C}, 0.1));
      w2.push_back(param({n.C, 4 * n.C}, 0.15));
      b2.push_back(param({n.C}, 0.1));
    }
    head = param({n.V, n.C}, 0.3);
    for (Tensor* p : params()) p->set_requires_grad();
  }
  std::vector<Tensor*> params() {
    std::vector<Tensor*> out{&emb, &head};
    for (int64_t l = 0; l < n.layers; ++l)
      for (std::vector<Tensor>* v : {&w1, &b1, &w2, &b2}) out.push_back(&(*v)[size_t(l)]);
    return out;
  }
  // One SGD step at `lr`; returns the loss (the step's output).
  Tensor step(const Tensor& idx, const Tensor& tg, double lr) {
    Tensor x = embedding(emb, idx);  // [B, T, C]
    for (size_t l = 0; l < size_t(n.layers); ++l)
      x = n.gelu ? x + linear(gelu(linear(x, w1[l], b1[l]), true), w2[l], b2[l])  // GELU and residual epilogues
                 : x + linear(relu(linear(x, w1[l]) + b1[l]), w2[l], b2[l]);  // a bias and a residual epilogue
    const Tensor logits = linear(x, head);
    Tensor loss = cross_entropy(reshape(logits, {n.B * n.T, n.V}), reshape(tg, {n.B * n.T}));
    loss.backward();
    NoGradGuard ng;
    for (Tensor* p : params()) {
      add_(*p, mul(p->grad(), -lr));
      p->zero_grad();
    }
    return loss;
  }
  // Step s's token ids and targets (on the CPU).
  std::pair<Tensor, Tensor> batch(int s) const {
    std::vector<double> in, tg;
    for (int64_t i = 0; i < n.B * n.T; ++i) {
      in.push_back(double((s * 13 + i * 7) % n.V));
      tg.push_back(double((s * 13 + i * 7 + 3) % n.V));
    }
    return {from_vector(in, {n.B, n.T}, DType::i32), from_vector(tg, {n.B, n.T}, DType::i32)};
  }
};

}  // namespace blu::test
