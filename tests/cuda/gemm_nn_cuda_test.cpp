// GPU tests for the linalg/nn/optim kernels (the gemm itself: gemm_cuda_test.cpp): each against
// the CPU backend or a double reference on the host, at odd sizes and GPT-2 sizes, with the
// tolerances justified where they are set, plus run-to-run determinism where the kernels promise it.
// Every test skips when no CUDA device is present. Run: ctest -L cuda, or build-cuda/tests/test_cuda.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "blu/backend/cuda/gemm.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/core/split_f32.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/reduce.h"
#include "blu/ops/optim.h"
#include "blu/ops/precision.h"
#include "blu/ops/view.h"
#include "common/checks.h"
#include "cuda/close_check.h"
#include "cuda/cuda_test_util.h"
#include "ops/donated_logits_check.h"

namespace blu {
namespace {

using cuda::GemmCompute;
using test::dev;
using test::host;
using test::bitwise_equal;
using test::kGPU;
using test::bit_equal;
using test::close;
using test::f64;
using test::gemm_tol;
using test::hvec;
using test::rnd;
using test::Tol;

// --- matmul / linear ops against the CPU backend ---------------------------------------------

Tol op_tol(DType dt) {
  return dt == DType::f32 ? Tol{0, 0, 1e-5} : dt == DType::f64 ? Tol{0, 0, 1e-12} : gemm_tol(dt, GemmCompute::f16_f32);
}

TEST(CudaMatmul, BatchedTransposedBroadcastAndPackedOperands) {
  SKIP_WITHOUT_CUDA();
  manual_seed(3);
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    // Views are made on the device so the kernel sees their strides.
    NoGradGuard ng;
    const Tensor a = rnd({3, 37, 71}, dt), b = rnd({3, 53, 71}, dt);
    const Tensor bt = transpose(b, 1, 2);
    {
      const Tensor got = matmul(dev(a), transpose(dev(b), 1, 2));
      const auto sv = to_vector(matmul(abs(f64(a)), abs(f64(bt))));
      EXPECT_TRUE(close(std::string("batched a·bᵀ ") + std::string(dtype_name(dt)), hvec(got),
                        to_vector(matmul(f64(a), f64(bt))), op_tol(dt), &sv));
    }
    {  // batch broadcast: [4, 1, 37, 71] · [3, 71, 53] → a's dim 1 expanded (batch stride 0)
      const Tensor a4 = rnd({4, 1, 37, 71}, dt), b3 = rnd({3, 71, 53}, dt);
      const Tensor got = matmul(dev(a4), dev(b3));
      const auto sv = to_vector(matmul(abs(f64(a4)), abs(f64(b3))));
      EXPECT_TRUE(close(std::string("broadcast batch ") + std::string(dtype_name(dt)), hvec(got),
                        to_vector(matmul(f64(a4), f64(b3))), op_tol(dt), &sv));
    }
    {  // a row expanded to a matrix (row stride 0: must be packed) times a transposed matrix
      const Tensor row = rnd({1, 71}, dt), b2 = rnd({53, 71}, dt);
      const Tensor got = matmul(expand(dev(row), {37, 71}), transpose(dev(b2), 0, 1));
      const Tensor ra = expand(row, {37, 71}), rb = transpose(b2, 0, 1);
      const auto sv = to_vector(matmul(abs(f64(ra)), abs(f64(rb))));
      EXPECT_TRUE(close(std::string("packed operand ") + std::string(dtype_name(dt)), hvec(got),
                        to_vector(matmul(f64(ra), f64(rb))), op_tol(dt), &sv));
    }
    {  // 1-D operands
      const Tensor v = rnd({71}, dt), m = rnd({71, 53}, dt);
      const auto sv = to_vector(matmul(abs(f64(v)), abs(f64(m))));
      EXPECT_TRUE(close(std::string("vector·matrix ") + std::string(dtype_name(dt)), hvec(matmul(dev(v), dev(m))),
                        to_vector(matmul(f64(v), f64(m))), op_tol(dt), &sv));
    }
  }
}

TEST(CudaLinear, WithAndWithoutBiasEveryDtype) {
  SKIP_WITHOUT_CUDA();
  manual_seed(4);
  NoGradGuard ng;
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (bool with_bias : {true, false}) {
      const Tensor x = rnd({2, 19, 71}, dt), w = rnd({53, 71}, dt), b = with_bias ? rnd({53}, dt) : Tensor();
      const Tensor got = linear(dev(x), dev(w), with_bias ? dev(b) : Tensor());
      const Tensor ref = linear(f64(x), f64(w), with_bias ? f64(b) : Tensor());
      const Tensor scale = linear(abs(f64(x)), abs(f64(w)), with_bias ? abs(f64(b)) : Tensor());
      const auto sv = to_vector(scale);
      EXPECT_EQ(got.shape(), ref.shape());
      EXPECT_TRUE(close(std::string("linear ") + std::string(dtype_name(dt)) + (with_bias ? " +bias" : ""), hvec(got),
                        to_vector(ref), op_tol(dt), &sv));
    }
  }
}

// RAII: restores IEEE matmuls even when a check fails.
struct PrecisionGuard {
  ~PrecisionGuard() { set_matmul_precision(MatmulPrecision::ieee); }
};

// linear_weight_grad at GPT-2-like sizes: the plain GEMM + deterministic column-sum path (rows
// not a multiple of the row chunk, 8-aligned widths) and the BGRAD-epilogue path (odd width).
TEST(CudaLinear, WeightGradColumnSumPathsMatchCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(12);
  NoGradGuard ng;
  for (DType dt : {DType::f32, DType::bf16})
    for (auto [R, N, K] : {std::tuple{1000, 768, 96}, std::tuple{4100, 2304, 64}, std::tuple{300, 37, 40}}) {
      const std::string tag = std::string(dtype_name(dt)) + " R=" + std::to_string(R) + " N=" + std::to_string(N);
      const Tensor g = rnd({R, N}, dt), x = rnd({R, K}, dt);
      const std::vector<Tensor> c = linear_weight_grad(g, x), d = linear_weight_grad(dev(g), dev(x));
      const double sr = std::sqrt(double(R));
      const Tol t = dt == DType::bf16 ? Tol{2e-2 * sr, 1.0 / 64, 0} : Tol{1e-4 * sr, 1e-5, 0};
      EXPECT_TRUE(close("grad_w " + tag, hvec(d[0]), to_vector(c[0]), t));
      EXPECT_TRUE(close("grad_b " + tag, hvec(d[1]), to_vector(c[1]), t));
      const std::vector<Tensor> d2 = linear_weight_grad(dev(g), dev(x));
      EXPECT_TRUE(bit_equal("grad_b rerun " + tag, d[1], d2[1]));
    }
}

// linear_weight_grad_into with fp32 outputs for bf16/f16 g (Note [Wide gradients]): the GEMM's
// fp32 sums stored unrounded and the bias gradient from the column-sum kernels (8-aligned width)
// or the strided-sum fallback (odd width), against the f64 products of the same 16-bit operands;
// and through linear's backward, an fp32 master weight cast to bf16 gets an fp32 gradient.
TEST(CudaLinear, WeightGradIntoFp32MatchesF64) {
  SKIP_WITHOUT_CUDA();
  manual_seed(13);
  NoGradGuard ng;
  for (DType dt : {DType::bf16, DType::f16})
    for (auto [R, N, K] : {std::tuple{1000, 768, 96}, std::tuple{300, 37, 40}, std::tuple{0, 16, 8}}) {
      const std::string tag = std::string(dtype_name(dt)) + " R=" + std::to_string(R) + " N=" + std::to_string(N);
      const Tensor g = rnd({R, N}, dt), x = rnd({R, K}, dt);
      Tensor gw = dev(full({N, K}, 7.0)), gb = dev(full({N}, 7.0));  // overwritten, not accumulated
      linear_weight_grad_into(gw, dev(g), dev(x), gb);
      const Tensor g64 = to_dtype(g, DType::f64), x64 = to_dtype(x, DType::f64);
      const std::vector<double> sv = to_vector(matmul(transpose(abs(g64), 0, 1), abs(x64)));
      EXPECT_TRUE(close("grad_w " + tag, hvec(gw), to_vector(matmul(transpose(g64, 0, 1), x64)), Tol{0, 0, 1e-5}, &sv));
      EXPECT_TRUE(close("grad_b " + tag, hvec(gb), to_vector(sum(g64, {0})), Tol{1e-5, 1e-6, 0}));
      Tensor gw_only = dev(zeros({N, K}));
      linear_weight_grad_into(gw_only, dev(g), dev(x));
      EXPECT_TRUE(bit_equal("grad_w without gb " + tag, gw_only, gw));
    }
}

TEST(CudaLinear, Bf16BackwardGivesFp32MasterWeightsFp32Gradients) {
  SKIP_WITHOUT_CUDA();
  manual_seed(14);
  Tensor w = dev(rnd({64, 96}, DType::f32)).set_requires_grad(), b = dev(rnd({64}, DType::f32)).set_requires_grad();
  const Tensor x = rnd({128, 96}, DType::bf16), g = rnd({128, 64}, DType::bf16);
  linear(dev(x), to_dtype(w, DType::bf16), to_dtype(b, DType::bf16)).backward(dev(g));
  ASSERT_EQ(w.grad().dtype(), DType::f32);
  ASSERT_EQ(b.grad().dtype(), DType::f32);
  const Tensor g64 = to_dtype(g, DType::f64);
  EXPECT_TRUE(close("linear backward grad_w", hvec(w.grad()),
                    to_vector(matmul(transpose(g64, 0, 1), to_dtype(x, DType::f64))), Tol{1e-5, 1e-6, 0}));
  EXPECT_TRUE(close("linear backward grad_b", hvec(b.grad()), to_vector(sum(g64, {0})), Tol{1e-5, 1e-6, 0}));
}

TEST(CudaMatmul, Tf32PrecisionSettingIsHonoured) {
  SKIP_WITHOUT_CUDA();
  manual_seed(5);
  NoGradGuard ng;
  PrecisionGuard guard;
  EXPECT_THROW(set_matmul_precision("fast"), Error);
  const Tensor a = rnd({256, 768}, DType::f32), b = rnd({768, 256}, DType::f32);
  const auto ref = to_vector(matmul(f64(a), f64(b)));
  const auto sv = to_vector(matmul(abs(f64(a)), abs(f64(b))));
  auto max_err = [&](const std::vector<double>& got) {
    double e = 0;
    for (size_t i = 0; i < got.size(); ++i) e = std::max(e, std::fabs(got[i] - ref[i]) / sv[i]);
    return e;
  };
  set_matmul_precision("ieee");
  const auto ieee = hvec(matmul(dev(a), dev(b)));
  set_matmul_precision("tf32");
  EXPECT_EQ(matmul_precision(), MatmulPrecision::tf32);
  const auto tf32 = hvec(matmul(dev(a), dev(b)));
  const double e_ieee = max_err(ieee), e_tf32 = max_err(tf32);
  std::printf("max error / Σ|a||b|: ieee %.3g, tf32 %.3g\n", e_ieee, e_tf32);
  EXPECT_LT(e_ieee, 1e-5);
  EXPECT_LT(e_tf32, 2e-3);
  // With K = 768 random inputs TF32 rounding is visible: it must not be silently IEEE.
  EXPECT_GT(e_tf32, 4 * e_ieee) << "tf32 mode gave IEEE-accurate results: is CUBLAS_COMPUTE_32F_FAST_TF32 used?";
}

// --- nn ops ----------------------------------------------------------------------------------
// Op definitions with the names of ops/nn.cpp's forward ops (every output) and backward ops, so
// the tests can call the kernels directly and see the saved statistics.

DType stat_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }
std::vector<TensorMeta> infer_ce(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& x = in[0];
  const Shape rows = x.dim() == 2 ? Shape{x.shape()[0]} : Shape{};
  return {TensorMeta{Reduction(a.i("reduction")) == Reduction::none ? rows : Shape{}, stat_dtype(x.dtype()),
                     x.device()},
          TensorMeta{rows, stat_dtype(x.dtype()), x.device()}};
}
std::vector<TensorMeta> like_input1(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[1].shape(), in[1].dtype(), in[1].device()}};
}
std::vector<TensorMeta> infer_ln(std::span<const Tensor> in, const Attrs&) {
  const Tensor& x = in[0];
  const Shape rows(x.shape().begin(), x.shape().end() - 1);
  return {TensorMeta{x.shape(), x.dtype(), x.device()}, TensorMeta{rows, stat_dtype(x.dtype()), x.device()},
          TensorMeta{rows, stat_dtype(x.dtype()), x.device()}};
}
std::vector<TensorMeta> infer_ln_bw(std::span<const Tensor> in, const Attrs&) {
  const Tensor& x = in[1];
  const TensorMeta p{Shape{x.shape().back()}, x.dtype(), x.device()};
  return {TensorMeta{x.shape(), x.dtype(), x.device()}, p, p};
}
std::vector<TensorMeta> infer_emb_bw(std::span<const Tensor> in, const Attrs& a) {
  return {TensorMeta{Shape{a.i("num_weights"), in[0].shape().back()}, in[0].dtype(), in[0].device()}};
}
const OpDef kCE{.name = "cross_entropy", .infer = infer_ce};
const OpDef kCEBackward{.name = "cross_entropy_backward", .infer = like_input1};
const OpDef kLN{.name = "layer_norm", .infer = infer_ln, .optional_inputs = 0b110};
const OpDef kLNBackward{.name = "layer_norm_backward", .infer = infer_ln_bw, .optional_inputs = 0b100};
const OpDef kSoftmaxBackward{.name = "softmax_backward", .infer = like_input1};
const OpDef kLogSoftmaxBackward{.name = "log_softmax_backward", .infer = like_input1};
const OpDef kEmbBackward{.name = "embedding_backward", .infer = infer_emb_bw};

// Tolerance for a row op's outputs of O(1) against the CPU (which sums rows in double): fp32
// sums of n terms err by ~√n·2^-24 relative; 16-bit outputs are rounded once on each side, so
// the two may differ by one ulp of the type (2^-8 bf16, 2^-11 f16).
Tol row_tol(DType dt) {
  switch (dt) {
    case DType::f64: return {1e-12, 1e-12, 0};
    case DType::f32: return {2e-6, 2e-5, 0};
    case DType::bf16: return {1e-6, 1.0 / 128, 0};
    default: return {1e-6, 1.0 / 1024, 0};
  }
}

TEST(CudaNN, SoftmaxAndLogSoftmaxForwardBackwardMatchCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(6);
  NoGradGuard ng;
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (int64_t dim : {2, 1}) {  // the last dim (row kernel) and a middle dim (column kernel)
      const std::string tag = std::string(dtype_name(dt)) + " dim " + std::to_string(dim);
      const Tensor x = rnd({5, 37, 1030}, dt, 3.0);
      const Tensor g = rnd({5, 37, 1030}, dt);
      for (bool lg : {false, true}) {
        const Tensor yc = lg ? log_softmax(x, dim) : softmax(x, dim);
        const Tensor yd = lg ? log_softmax(dev(x), dim) : softmax(dev(x), dim);
        EXPECT_TRUE(close((lg ? "log_softmax " : "softmax ") + tag, hvec(yd), to_vector(yc), row_tol(dt)));
        const OpDef& bw = lg ? kLogSoftmaxBackward : kSoftmaxBackward;
        const Tensor gc = dispatch1(bw, {g, yc}, Attrs{{"dim", dim}});
        const Tensor gd = dispatch1(bw, {dev(g), yd}, Attrs{{"dim", dim}});
        EXPECT_TRUE(close((lg ? "log_softmax_backward " : "softmax_backward ") + tag, hvec(gd), to_vector(gc),
                          Tol{row_tol(dt).abs * 10, row_tol(dt).rel_out * 4, 0}));
      }
    }
}

// cross_entropy over GPT-2's padded vocabulary, some targets ignored, every reduction: all 50304
// columns as classes, and (as GPT::forward calls it) only the first 50257 — the padded columns'
// gradient must then be written as exact zeros.
TEST(CudaNN, CrossEntropyV50304MatchesCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(7);
  NoGradGuard ng;
  const int64_t N = 64, V = 50304, ignore = -100;
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t K : {V, int64_t(50257)}) {
      const Tensor x = rnd({N, V}, dt, 4.0);
      std::vector<double> tv(static_cast<size_t>(N));
      const auto r = to_vector(randint(0, K, {N}));
      for (int64_t i = 0; i < N; ++i) tv[size_t(i)] = i % 7 == 3 ? double(ignore) : r[size_t(i)];
      tv[0] = double(K - 1);  // the last class (in the vector loads' scalar tail when K = 50257)
      for (DType it : {DType::i64, DType::i32}) {
        const Tensor t = from_vector(tv, {N}, it);
        const Tensor xd = dev(x), td = dev(t);
        for (Reduction red : {Reduction::none, Reduction::mean, Reduction::sum}) {
          const std::string tag = std::string(dtype_name(dt)) + " classes " + std::to_string(K) + " targets " +
                                  std::string(dtype_name(it)) + " reduction " + std::to_string(int(red));
          const Attrs attrs{{"ignore_index", ignore}, {"reduction", int64_t(red)}, {"classes", K}};
          const auto oc = dispatch(kCE, {x, t}, attrs);
          const auto od = dispatch(kCE, {xd, td}, attrs);
          // lse: fp32 online sum of ~50304 terms vs the CPU's double sum.
          EXPECT_TRUE(close("lse " + tag, hvec(od[1]), to_vector(oc[1]), Tol{1e-5, 1e-6, 0}));
          // The loss is lse - x[t] (O(10)), fp32 for both logit dtypes (bf16 logits are exact
          // in fp32, so only the fp32 lse sums differ from the CPU's double).
          EXPECT_EQ(od[0].dtype(), DType::f32) << tag;
          EXPECT_TRUE(close("loss " + tag, hvec(od[0]), to_vector(oc[0]), Tol{2e-5, 2e-6, 0}));
          // Backward from a random upstream gradient (a scalar for mean/sum), in the loss's dtype.
          const Tensor g = red == Reduction::none ? rnd({N}, DType::f32) : rnd({}, DType::f32);
          const Tensor gc = dispatch1(kCEBackward, {g, x, t, oc[1]}, attrs);
          const Tensor gd = dispatch1(kCEBackward, {dev(g), xd, td, od[1]}, attrs);
          // softmax probabilities are ≤ 1: an absolute tolerance relative to |g| works.
          const double gs = red == Reduction::mean ? 1.0 / N : 1.0;
          const Tol gt = dt == DType::f32 ? Tol{1e-6 * gs * 4, 1e-5, 0} : Tol{1e-4 * gs * 4, 1.0 / 128, 0};
          const auto gdv = hvec(gd);
          EXPECT_TRUE(close("dlogits " + tag, gdv, to_vector(gc), gt));
          if (K < V) {
            int64_t nonzero = 0;
            for (int64_t n = 0; n < N; ++n)
              for (int64_t k = K; k < V; ++k) nonzero += gdv[size_t(n * V + k)] != 0.0 ? 1 : 0;
            EXPECT_EQ(nonzero, 0) << "padded columns of dlogits must be exactly 0, " << tag;
          }
        }
      }
    }
}

// The cross-entropy on a shard of the classes (the vocabulary-parallel loss's kernels): the
// second of two shards of a 50,257-id vocabulary padded to 50,304, whose last 47 columns are
// padding; targets on both shards, ignored rows, the gradient written beside and over the logits.
TEST(CudaNN, CrossEntropyShardMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(11);
  const int64_t N = 48, V = 50257, Vl = 25152, off = Vl, cols = V - off, ignore = -1;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = rnd({N, Vl}, dt, 4.0);
    std::vector<double> tv(static_cast<size_t>(N));
    const auto r = to_vector(randint(0, V, {N}));
    for (int64_t i = 0; i < N; ++i) tv[size_t(i)] = i % 9 == 4 ? double(ignore) : r[size_t(i)];
    tv[0] = double(V - 1), tv[1] = double(off), tv[2] = double(off - 1);  // the shard's edges
    const Tensor t = from_vector(tv, {N}, DType::i64);
    const std::string tag(dtype_name(dt));
    const CrossEntropyShard c = cross_entropy_shard(x, t, cols, off, V, ignore);
    const CrossEntropyShard d = cross_entropy_shard(dev(x), dev(t), cols, off, V, ignore);
    EXPECT_TRUE(close("lse " + tag, hvec(d.lse), to_vector(c.lse), Tol{1e-5, 1e-6, 0}));
    EXPECT_TRUE(close("row loss " + tag, hvec(d.row_loss), to_vector(c.row_loss), Tol{2e-5, 2e-6, 0}));
    const auto rl = to_vector(c.row_loss);
    for (int64_t i = 0; i < N; ++i) {
      if (tv[size_t(i)] < double(off)) {
        EXPECT_EQ(rl[size_t(i)], 0.0) << "row " << i << " is the other shard's";
      }
    }
    // The whole vocabulary's logsumexp stands in for the shard's in the backward.
    const Tensor lse = add(c.lse, 0.75), g = rnd({N}, DType::f32);
    const Tensor gc = cross_entropy_shard_backward(x, t, lse, g, cols, off, V, ignore, false);
    const Tensor gd = cross_entropy_shard_backward(dev(x), dev(t), dev(lse), dev(g), cols, off, V, ignore, false);
    const Tol gt = dt == DType::f32 ? Tol{4e-6, 1e-5, 0} : Tol{4e-4, 1.0 / 128, 0};
    EXPECT_TRUE(close("dlogits " + tag, hvec(gd), to_vector(gc), gt));
    const Tensor over = dev(x);
    const Tensor go = cross_entropy_shard_backward(over, dev(t), dev(lse), dev(g), cols, off, V, ignore, true);
    EXPECT_EQ(go.raw_data(), over.raw_data()) << "overwrite must write over the logits";
    EXPECT_EQ(hvec(go), hvec(gd)) << tag;
  }
}

TEST(CudaNN, LayerNormForwardBackwardMatchCpuAndIsDeterministic) {
  SKIP_WITHOUT_CUDA();
  manual_seed(8);
  NoGradGuard ng;
  struct Case {
    int64_t R, C;
    bool weight, bias;
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    // The vectorised path at several widths (1 to 8 vectors a lane; 5000 rows: several rows per
    // warp in the backward), and the general kernels (100 bf16 and 37 columns, f64).
    for (Case cs : {Case{4096, 768, true, true}, Case{5000, 1600, true, true}, Case{1000, 1024, true, false},
                    Case{100, 64, false, true}, Case{333, 100, true, false}, Case{65, 37, false, false}}) {
      const std::string tag = std::string(dtype_name(dt)) + " R=" + std::to_string(cs.R) + " C=" +
                              std::to_string(cs.C) + (cs.weight ? " +w" : "") + (cs.bias ? " +b" : "");
      const Tensor x = add(rnd({cs.R, cs.C}, dt, 2.0), 0.5);
      const Tensor w = cs.weight ? rnd({cs.C}, dt) : Tensor(), b = cs.bias ? rnd({cs.C}, dt) : Tensor();
      const Tensor wd = cs.weight ? dev(w) : Tensor(), bd = cs.bias ? dev(b) : Tensor();
      const Attrs attrs{{"eps", 1e-5}};
      const auto oc = dispatch(kLN, {x, w, b}, attrs);
      const auto od = dispatch(kLN, {dev(x), wd, bd}, attrs);
      EXPECT_TRUE(close("y " + tag, hvec(od[0]), to_vector(oc[0]), row_tol(dt)));
      EXPECT_TRUE(close("mean " + tag, hvec(od[1]), to_vector(oc[1]), Tol{1e-6, 1e-5, 0}));
      EXPECT_TRUE(close("rstd " + tag, hvec(od[2]), to_vector(oc[2]), Tol{1e-6, 1e-5, 0}));
      const Tensor g = rnd({cs.R, cs.C}, dt);
      const auto gc = dispatch(kLNBackward, {g, x, w, oc[1], oc[2]});
      const auto gd = dispatch(kLNBackward, {dev(g), dev(x), wd, od[1], od[2]});
      EXPECT_TRUE(close("grad_x " + tag, hvec(gd[0]), to_vector(gc[0]),
                        Tol{row_tol(dt).abs * 20, row_tol(dt).rel_out * 4, 0}));
      // Column sums over R rows of O(1) terms: fp32 partial sums err by ~√R·2^-24 each.
      const double sr = std::sqrt(double(cs.R));
      const Tol pt = dt == DType::bf16 ? Tol{1e-3 * sr, 1.0 / 128, 0} : dt == DType::f32 ? Tol{1e-5 * sr, 1e-5, 0}
                                                                                        : Tol{1e-10, 1e-10, 0};
      EXPECT_TRUE(close("grad_w " + tag, hvec(gd[1]), to_vector(gc[1]), pt));
      EXPECT_TRUE(close("grad_b " + tag, hvec(gd[2]), to_vector(gc[2]), pt));
      const auto gd2 = dispatch(kLNBackward, {dev(g), dev(x), wd, od[1], od[2]});
      EXPECT_TRUE(bit_equal("grad_w rerun " + tag, gd[1], gd2[1]));
      EXPECT_TRUE(bit_equal("grad_b rerun " + tag, gd[2], gd2[2]));
      EXPECT_TRUE(bit_equal("grad_x rerun " + tag, gd[0], gd2[0]));
    }
}

// Cross-entropy's backward over logits nobody holds any more (Note [Donated buffers]): GPT's
// [B·T, V] logits take their own gradient, one such buffer fewer at the step's peak.
TEST(CudaNN, CrossEntropyBackwardWritesOverDroppedLogits) {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) test::check_donated_logits(kGPU, dt);
}

TEST(CudaNN, EmbeddingForwardAndDeterministicBackward) {
  SKIP_WITHOUT_CUDA();
  manual_seed(9);
  NoGradGuard ng;
  const int64_t V = 50304, C = 768, B = 16, T = 1024;
  // Many repeats: most tokens from a 64-word head, one token in 8 anywhere in the vocabulary,
  // and token 0 at every 16th position (a run of 1024 repeats).
  const auto head = to_vector(randint(0, 64, {B * T}));
  const auto any = to_vector(randint(0, V, {B * T}));
  std::vector<double> iv(size_t(B * T));
  for (size_t i = 0; i < iv.size(); ++i) iv[i] = i % 16 == 0 ? 0.0 : i % 8 == 1 ? any[i] : head[i];
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor w = rnd({V, C}, dt), idx = from_vector(iv, {B, T}, DType::i64);
    const Tensor wd = dev(w), idd = dev(idx);
    EXPECT_TRUE(bit_equal(std::string("embedding forward ") + std::string(dtype_name(dt)), embedding(wd, idd),
                          embedding(w, idx)));
    // An index outside [0, V) cannot be reported without a host sync: its row reads NaN (the CPU
    // raises), in the vectorised kernel (C = 768) and the scalar one (a row stride of 3 columns).
    for (const Tensor& table : {wd, contiguous(narrow(wd, 1, 0, 3))}) {
      const Tensor bad = dev(from_vector({1.0, double(V), -1.0}, {3}, DType::i64));
      const auto rows = to_vector(to_device(embedding(table, bad), kCPU));
      const int64_t width = table.size(1);
      for (int64_t k = 0; k < 3 * width; ++k)
        EXPECT_EQ(std::isnan(rows[size_t(k)]), k >= width) << dtype_name(dt) << " width " << width << " element " << k;
    }
    const Tensor g = rnd({B, T, C}, dt), gdv = dev(g);
    const Attrs attrs{{"num_weights", V}};
    const Tensor r1 = dispatch1(kEmbBackward, {gdv, idd}, attrs);
    const Tensor r2 = dispatch1(kEmbBackward, {gdv, idd}, attrs);
    EXPECT_TRUE(bit_equal(std::string("embedding backward rerun ") + std::string(dtype_name(dt)), r1, r2));
    // Same summation order as the CPU (stable sort, rows added in position order, fp32
    // accumulation, one rounding): bit-identical to the CPU as well.
    const Tensor rc = dispatch1(kEmbBackward, {g, idx}, attrs);
    EXPECT_TRUE(bit_equal(std::string("embedding backward vs CPU ") + std::string(dtype_name(dt)), r1, rc));
    // i32 indices take the same path.
    const Tensor r32 = dispatch1(kEmbBackward, {gdv, dev(to_dtype(idx, DType::i32))}, attrs);
    EXPECT_TRUE(bit_equal("embedding backward i32 indices", r1, r32));
    // embedding_backward_add_ (DDP's row exchange): scale · the rows added into a gradient that
    // holds values, deterministic on the GPU, and the CPU's up to the GPU's fused multiply-add.
    const Tensor base = rnd({V, C}, dt);
    Tensor a1 = dev(base), a2 = dev(base), ac = clone(base);
    embedding_backward_add_(a1, gdv, idd, 0.5);
    embedding_backward_add_(a2, gdv, idd, 0.5);
    embedding_backward_add_(ac, g, idx, 0.5);
    EXPECT_TRUE(bit_equal(std::string("embedding_backward_add_ rerun ") + std::string(dtype_name(dt)), a1, a2));
    const auto got = to_vector(to_device(a1, kCPU)), want = to_vector(ac);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, std::abs(got[i] - want[i]));
      scale = std::max(scale, std::abs(want[i]));
    }
    EXPECT_LE(worst, (dt == DType::f32 ? 1e-6 : 1e-2) * scale) << "embedding_backward_add_ vs CPU " << dtype_name(dt);
    // Into the window of rows [V/3, V/3 + V/2) (ZeRO-2's row exchange): the CPU's window, and
    // rows outside it untouched.
    const int64_t first = V / 3, rows = V / 2;
    Tensor wd1 = dev(narrow(base, 0, first, rows)), wc = clone(narrow(base, 0, first, rows));
    embedding_backward_add_window_(wd1, gdv, idd, first, 0.5);
    embedding_backward_add_window_(wc, g, idx, first, 0.5);
    const auto wg = to_vector(to_device(wd1, kCPU)), ww = to_vector(wc);
    double wworst = 0;
    for (size_t i = 0; i < ww.size(); ++i) wworst = std::max(wworst, std::abs(wg[i] - ww[i]));
    EXPECT_LE(wworst, (dt == DType::f32 ? 1e-6 : 1e-2) * scale) << "embedding_backward_add_window_ vs CPU " << dtype_name(dt);
    EXPECT_NE(to_vector(wc), to_vector(clone(narrow(base, 0, first, rows)))) << "the window test adds no row";
  }
}

TEST(CudaNN, DropoutMasksMatchCpuBitForBit) {
  SKIP_WITHOUT_CUDA();
  manual_seed(10);
  NoGradGuard ng;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = rnd({1001, 333}, dt);
    Generator gc(1234, 77), gd(1234, 77);
    EXPECT_TRUE(bit_equal("dropout contiguous", dropout(dev(x), 0.1, true, &gd), dropout(x, 0.1, true, &gc)));
    // A transposed (non-contiguous) input: the mask follows the logical row-major index.
    EXPECT_TRUE(bit_equal("dropout transposed", dropout(transpose(dev(x), 0, 1), 0.3, true, &gd),
                          dropout(transpose(x, 0, 1), 0.3, true, &gc)));
    EXPECT_TRUE(bit_equal("dropout p=1", dropout(dev(x), 1.0, true, &gd), dropout(x, 1.0, true, &gc)));
  }
}

// --- optimizer kernels -----------------------------------------------------------------------

// Largest distance in units in the last place between two f32 tensors.
int64_t max_ulp(const Tensor& a, const Tensor& b) {
  const Tensor ca = contiguous(a.device().is_cpu() ? a : host(a)), cb = contiguous(b.device().is_cpu() ? b : host(b));
  const float* pa = ca.data<float>();
  const float* pb = cb.data<float>();
  auto ord = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
  };
  int64_t m = 0;
  for (int64_t i = 0; i < ca.numel(); ++i) m = std::max<int64_t>(m, int64_t(std::llabs(ord(pa[i]) - ord(pb[i]))));
  return m;
}

TEST(CudaOptim, AdamWTenStepsWithinOneUlpOfCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(11);
  NoGradGuard ng;
  const Shape s{1000, 123};
  Tensor pc = randn(s), mc = zeros(s), vc = zeros(s);
  Tensor pd = dev(pc), md = dev(mc), vd = dev(vc);
  const AdamWStepArgs base{6e-4, 0.9, 0.95, 1e-8, 0.1, 1};
  for (int64_t step = 1; step <= 10; ++step) {
    const Tensor g = mul(randn(s), 1e-2 * double(step));
    AdamWStepArgs a = base;
    a.step = step;
    adamw_step_({{pc, g, mc, vc}}, a);
    adamw_step_({{pd, dev(g), md, vd}}, a);
    EXPECT_LE(max_ulp(pd, pc), 1) << "param after step " << step;
    EXPECT_LE(max_ulp(md, mc), 1) << "exp_avg after step " << step;
    EXPECT_LE(max_ulp(vd, vc), 1) << "exp_avg_sq after step " << step;
  }
  // Non-contiguous parameter views take the strided path.
  Tensor pt = dev(randn({64, 32})), gt = dev(randn({64, 32}));
  Tensor pth = host(pt), gth = host(gt);
  Tensor mt = dev(zeros({32, 64})), vt = dev(zeros({32, 64}));
  Tensor mth = zeros({32, 64}), vth = zeros({32, 64});
  adamw_step_({{transpose(pt, 0, 1), transpose(gt, 0, 1), mt, vt}}, base);
  adamw_step_({{transpose(pth, 0, 1), transpose(gth, 0, 1), mth, vth}}, base);
  EXPECT_LE(max_ulp(pt, pth), 1) << "strided param";
}

// Split masters (Note [Split fp32], core/split_f32.h): the device's update of (copy, low halves)
// is the CPU's bit for bit — the float4 path, the tail and a tensor whose moments are strided —
// with a clipping gate, with f32 and with bf16 moments (Note [Stochastic bf16 moments]).
TEST(CudaOptim, SplitMastersMatchCpuBitwise) {
  SKIP_WITHOUT_CUDA();
  manual_seed(12);
  NoGradGuard ng;
  for (DType state : {DType::f32, DType::bf16}) {
  SCOPED_TRACE(std::string("moments ") + std::string(dtype_name(state)));
  std::vector<Tensor> pc, cc, lc, mc, vc, pd, cd, ld, md, vd;
  for (const Shape& s : std::vector<Shape>{{1000, 123}, {37}, {5, 8}}) {
    const Tensor p = randn(s);
    Tensor hi = empty(s, DType::bf16), lo = empty({2 * p.numel()}, DType::u8);
    for (int64_t i = 0; i < p.numel(); ++i)
      split_f32(p.data<float>()[i], static_cast<uint16_t*>(hi.raw_data())[i], static_cast<uint16_t*>(lo.raw_data())[i]);
    pc.push_back(p);
    cc.push_back(hi);
    lc.push_back(lo);
    mc.push_back(to_dtype(mul(randn(s), 0.1), state));
    vc.push_back(to_dtype(abs(mul(randn(s), 0.01)), state));
    pd.push_back(dev(p));
    cd.push_back(dev(hi));
    ld.push_back(dev(lo));
    md.push_back(dev(mc.back()));
    vd.push_back(dev(vc.back()));
  }
  md[2] = transpose(dev(contiguous(transpose(mc[2], 0, 1))), 0, 1);  // strided moments: the strided kernel
  for (int64_t step = 1; step <= 4; ++step) {
    std::vector<AdamWTensors> a, b;
    for (size_t i = 0; i < pc.size(); ++i) {
      const Tensor g = mul(randn(pc[i].shape()), 1e-2 * double(step));
      a.push_back({pc[i], g, mc[i], vc[i], cc[i], lc[i]});
      b.push_back({pd[i], dev(g), md[i], vd[i], cd[i], ld[i]});
    }
    const AdamWStepArgs args{6e-4, 0.9, 0.95, 1e-8, 0.1, step};
    adamw_step_(a, args, {full({}, 50.0), 1.0});
    adamw_step_(b, args, {dev(full({}, 50.0)), 1.0});
    for (size_t i = 0; i < pc.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(host(cd[i]), cc[i])) << "copy " << i << " step " << step;
      EXPECT_TRUE(bitwise_equal(host(ld[i]), lc[i])) << "low halves " << i << " step " << step;
      EXPECT_TRUE(bitwise_equal(contiguous(host(md[i])), mc[i])) << "exp_avg " << i << " step " << step;
      EXPECT_TRUE(bitwise_equal(host(vd[i]), vc[i])) << "exp_avg_sq " << i << " step " << step;
    }
  }
  }
}

TEST(CudaOptim, SgdMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(12);
  NoGradGuard ng;
  const Shape s{777, 13};
  for (bool nesterov : {false, true}) {
    Tensor pc = randn(s), bc = zeros(s);
    Tensor pd = dev(pc), bd = dev(bc);
    for (int step = 0; step < 5; ++step) {
      const Tensor g = randn(s);
      const SGDStepArgs a{0.01, 0.9, 1e-4, nesterov, step == 0};
      sgd_step_(pc, g, bc, a);
      sgd_step_(pd, dev(g), bd, a);
      EXPECT_LE(max_ulp(pd, pc), 1) << "param, nesterov " << nesterov << ", step " << step;
      EXPECT_LE(max_ulp(bd, bc), 1) << "momentum buffer, nesterov " << nesterov << ", step " << step;
    }
    Tensor p2c = randn(s), p2d = dev(p2c);  // no momentum buffer
    const Tensor g = randn(s);
    sgd_step_(p2c, g, Tensor(), SGDStepArgs{0.1, 0, 0, false, false});
    sgd_step_(p2d, dev(g), Tensor(), SGDStepArgs{0.1, 0, 0, false, false});
    EXPECT_LE(max_ulp(p2d, p2c), 1) << "plain SGD";
  }
}

}  // namespace
}  // namespace blu
