// GPU tests for the CUDA gemm (cuBLASLt), the linalg/nn/optim kernels: each against the CPU
// backend or a double reference on the host, at odd sizes and GPT-2 sizes, with the tolerances
// justified where they are set, plus run-to-run determinism where the kernels promise it.
// Every test skips when no CUDA device is present. Run: ctest -L cuda, or build-cuda/tests/test_cuda.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "blu/backend/cuda/gemm.h"
#include "blu/backend/gemm_tune_table.h"
#include "blu/backend/cuda/runtime.h"
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
#include "cuda/cuda_test_util.h"
#include "ops/donated_logits_check.h"

namespace blu {
namespace {

using cuda::GemmArgs;
using cuda::GemmCompute;
using cuda::GemmEpilogue;
using test::dev;
using test::host;
using test::kGPU;

std::vector<double> hvec(const Tensor& t) { return to_vector(t.device().is_cpu() ? t : host(t)); }
Tensor f64(const Tensor& t) { return to_dtype(t.device().is_cpu() ? t : host(t), DType::f64); }
// Random values exactly representable in dtype (drawn in f32, rounded once).
Tensor rnd(const Shape& s, DType dt, double scale = 1.0) { return to_dtype(mul(randn(s), scale), dt); }

// Element i passes when |got - ref| <= abs + rel_out·|ref| + rel_scale·scale_i (scale_i = |ref|
// when no scale is given). Reports the worst element (by err/allowed) and the first failures.
struct Tol {
  double abs = 0, rel_out = 0, rel_scale = 0;
};
::testing::AssertionResult close(const std::string& what, const std::vector<double>& got,
                                 const std::vector<double>& ref, Tol tol, const std::vector<double>* scale = nullptr) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs reference " << ref.size();
  size_t bad = 0, worst = 0;
  double worst_ratio = 0, max_err = 0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    const double s = scale ? (*scale)[i] : std::fabs(ref[i]);
    const double allowed = tol.abs + tol.rel_out * std::fabs(ref[i]) + tol.rel_scale * s;
    const bool ok = err <= allowed || (std::isnan(got[i]) && std::isnan(ref[i]));
    const double ratio = ok ? 0.0 : allowed > 0 && !std::isnan(err) ? err / allowed : INFINITY;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
    max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
    if (!ok && bad++ < 5)
      first << "\n  [" << i << "] got " << got[i] << " want " << ref[i] << " (err " << err << ", allowed " << allowed
            << ")";
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size()
                                       << " elements out of tolerance (abs " << tol.abs << ", rel_out " << tol.rel_out
                                       << ", rel_scale " << tol.rel_scale << "); max |err| " << max_err
                                       << "; worst at " << worst << " (err/allowed " << worst_ratio << ")"
                                       << first.str();
}
::testing::AssertionResult bit_equal(const std::string& what, const Tensor& a, const Tensor& b) {
  const Tensor ha = a.device().is_cpu() ? a : host(a), hb = b.device().is_cpu() ? b : host(b);
  if (ha.nbytes() != hb.nbytes() || ha.dtype() != hb.dtype())
    return ::testing::AssertionFailure() << what << ": " << ha.str() << " vs " << hb.str();
  const Tensor ca = contiguous(ha), cb = contiguous(hb);
  const auto* pa = static_cast<const unsigned char*>(ca.raw_data());
  const auto* pb = static_cast<const unsigned char*>(cb.raw_data());
  const size_t es = ca.itemsize();
  size_t diff = 0, first = SIZE_MAX;
  for (size_t i = 0; i < size_t(ca.numel()); ++i)
    if (std::memcmp(pa + i * es, pb + i * es, es) != 0 && diff++ == 0) first = i;
  if (diff == 0) return ::testing::AssertionSuccess();
  const auto va = to_vector(ca), vb = to_vector(cb);
  return ::testing::AssertionFailure() << what << ": " << diff << " of " << ca.numel()
                                       << " elements differ bitwise; first at " << first << ": " << va[first]
                                       << " vs " << vb[first];
}

// --- gemm ------------------------------------------------------------------------------------

// Tolerances, relative to scale = Σ_k |a_ik|·|b_kj| (the size of the terms summed):
//  - f32 IEEE: fp32 products and sums; the rounding error of a K-term sum grows like √K·2^-24 in
//    practice (≈ 3e-6 at K = 3072): 1e-5 as the brief demands.
//  - TF32: each input is rounded to 11 significant bits (relative error ≤ 2^-11), so each product
//    is off by ≤ 2·2^-11 ≈ 1e-3 of its size; 2e-3 leaves room for the fp32 sums.
//  - bf16 / f16: inputs are exact in the reference (it multiplies the same rounded values), sums
//    are fp32 (1e-5 as f32), and the output is rounded once to 8 (bf16) / 11 (f16) significant
//    bits. Measured on an H200: cuBLASLt rounds the product to the output type before a bias or
//    GELU epilogue is applied (a second rounding), and its fp32 sums run in another order than
//    ours, so results land up to ~2 (bf16) / ~3 (f16) ulps from the reference: we allow 2^-7 and
//    2^-8 of |ref| (2 bf16 ulps, 4 f16 ulps). Because the product is rounded before the bias is
//    added, a result that cancels (C + bias ≈ 0) carries half an ulp of |C|, not of the result:
//    hence also 2^-8 (bf16) / 2^-11 (f16) of scale_i ≥ |C|.
//  - f64: 1e-12.
Tol gemm_tol(DType dt, GemmCompute c) {
  switch (c) {
    case GemmCompute::f32_ieee: return {0, 0, 1e-5};
    case GemmCompute::f32_tf32: return {0, 0, 2e-3};
    case GemmCompute::f64: return {0, 0, 1e-12};
    case GemmCompute::f16_f32: return dt == DType::bf16 ? Tol{0, 1.0 / 128, 1.0 / 256} : Tol{0, 1.0 / 256, 1.0 / 2048};
  }
  return {};
}
const char* compute_name(GemmCompute c) {
  switch (c) {
    case GemmCompute::f32_ieee: return "f32-ieee";
    case GemmCompute::f32_tf32: return "f32-tf32";
    case GemmCompute::f16_f32: return "f16/bf16-f32acc";
    case GemmCompute::f64: return "f64";
  }
  return "?";
}

double gelu_tanh(double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

struct GemmCase {
  DType dtype;
  GemmCompute compute;
  bool ta, tb;  // A (B) stored transposed: the operand is a transposed view of a [K, M] ([N, K]) buffer
  int64_t M, N, K;
  GemmEpilogue epi;
  std::string str() const {
    std::ostringstream os;
    os << dtype << " " << compute_name(compute) << (ta ? " Aᵀ" : " A") << (tb ? " Bᵀ" : " B") << " M=" << M
       << " N=" << N << " K=" << K << " epilogue=" << cuda::gemm_epilogue_name(epi);
    return os.str();
  }
};

void run_gemm_case(const GemmCase& gc) {
  SCOPED_TRACE(gc.str());
  NoGradGuard ng;
  const int64_t M = gc.M, N = gc.N, K = gc.K;
  // Stored buffers on the host; logical operands are (transposed) views of them.
  const Tensor a_store = gc.ta ? rnd({K, M}, gc.dtype) : rnd({M, K}, gc.dtype);
  const Tensor b_store = gc.tb ? rnd({N, K}, gc.dtype) : rnd({K, N}, gc.dtype);
  const Tensor a_log = gc.ta ? transpose(a_store, 0, 1) : a_store;
  const Tensor b_log = gc.tb ? transpose(b_store, 0, 1) : b_store;
  const Tensor bias = rnd({N}, gc.dtype);
  const Tensor a_dev = dev(a_store), b_dev = dev(b_store), bias_dev = dev(bias);
  const Tensor c_dev = empty({M, N}, gc.dtype, kGPU);
  const Tensor aux_dev = empty({M, N}, gc.dtype, kGPU);
  const int64_t bias_len = gc.epi == GemmEpilogue::bgrad_a ? M : N;
  const Tensor bgrad_dev = empty({bias_len}, gc.dtype, kGPU);

  GemmArgs g;
  g.dtype = gc.dtype;
  g.compute = gc.compute;
  g.M = M;
  g.N = N;
  g.K = K;
  g.a = {a_dev.raw_data(), gc.ta ? 1 : K, gc.ta ? M : 1, 0};
  g.b = {b_dev.raw_data(), gc.tb ? 1 : N, gc.tb ? K : 1, 0};
  g.c = c_dev.raw_data();
  g.ldc = N;
  g.epilogue = gc.epi;
  g.bias = bias_dev.raw_data();
  g.bias_grad = bgrad_dev.raw_data();
  g.aux = aux_dev.raw_data();
  g.aux_ld = N;
  // Called directly, outside dispatch: the stream and cuBLASLt workspace of the current context.
  const ExecContext& ctx = current_context(c_dev.device());
  ctx.scratch->reset();
  ASSERT_NO_THROW(cuda::gemm(g, cuda::stream_of(ctx), ctx.scratch->take(cuda::kGemmWorkspaceBytes)));

  const Tensor a64 = f64(a_log), b64 = f64(b_log);
  std::vector<double> ref = to_vector(matmul(a64, b64));
  std::vector<double> scale = to_vector(matmul(abs(a64), abs(b64)));
  const Tol tol = gemm_tol(gc.dtype, gc.compute);
  const std::vector<double> bias_v = to_vector(bias);
  const std::vector<double> got = hvec(c_dev);
  if (gc.epi == GemmEpilogue::none || gc.epi == GemmEpilogue::bgrad_a || gc.epi == GemmEpilogue::bgrad_b) {
    EXPECT_TRUE(close("C", got, ref, tol, &scale));
  } else {
    std::vector<double> pre(ref.size()), pre_scale(ref.size());
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        pre[size_t(i * N + j)] = ref[size_t(i * N + j)] + bias_v[size_t(j)];
        pre_scale[size_t(i * N + j)] = scale[size_t(i * N + j)] + std::fabs(bias_v[size_t(j)]);
      }
    if (gc.epi == GemmEpilogue::bias) {
      EXPECT_TRUE(close("C + bias", got, pre, tol, &pre_scale));
    } else {
      // GELU: |gelu'| <= 1.13 carries the pre-activation's error through; cuBLASLt may evaluate
      // tanh with the hardware approximation (relative error about 2^-11), worth ≤ 5e-4·|x| more.
      std::vector<double> post(pre.size()), post_scale(pre.size());
      for (size_t i = 0; i < pre.size(); ++i) {
        post[i] = gelu_tanh(pre[i]);
        post_scale[i] = 1.13 * pre_scale[i] + (5e-4 / std::max(tol.rel_scale, 1e-12)) * std::fabs(pre[i]);
      }
      EXPECT_TRUE(close("gelu(C + bias)", got, post, Tol{1e-6, tol.rel_out, tol.rel_scale}, &post_scale));
      if (gc.epi == GemmEpilogue::gelu_aux_bias) {
        EXPECT_TRUE(close("aux = C + bias", hvec(aux_dev), pre, tol, &pre_scale));
      }
    }
  }
  if (gc.epi == GemmEpilogue::bgrad_a || gc.epi == GemmEpilogue::bgrad_b) {
    // Σ over K of A's rows (bgrad_a) or B's columns (bgrad_b).
    const std::vector<double> av = to_vector(contiguous(a64)), bv = to_vector(contiguous(b64));
    std::vector<double> bref(size_t(bias_len), 0.0), bscale(size_t(bias_len), 0.0);
    for (int64_t i = 0; i < bias_len; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const double v = gc.epi == GemmEpilogue::bgrad_a ? av[size_t(i * K + k)] : bv[size_t(k * N + i)];
        bref[size_t(i)] += v;
        bscale[size_t(i)] += std::fabs(v);
      }
    EXPECT_TRUE(close("bias gradient", hvec(bgrad_dev), bref, tol, &bscale));
  }
}

struct Mode {
  DType dtype;
  GemmCompute compute;
};
const Mode kModes[] = {{DType::f32, GemmCompute::f32_ieee},
                       {DType::f32, GemmCompute::f32_tf32},
                       {DType::bf16, GemmCompute::f16_f32},
                       {DType::f16, GemmCompute::f16_f32}};

TEST(CudaGemm, EveryDtypeTranspositionAndEpilogueAtOddSizes) {
  SKIP_WITHOUT_CUDA();
  manual_seed(1);
  for (const Mode& m : kModes)
    for (int t = 0; t < 4; ++t)
      for (GemmEpilogue e : {GemmEpilogue::none, GemmEpilogue::bias, GemmEpilogue::gelu_bias, GemmEpilogue::bgrad_a,
                             GemmEpilogue::bgrad_b})
        run_gemm_case({m.dtype, m.compute, bool(t & 1), bool(t & 2), 37, 53, 71, e});
  // GELU_AUX needs the aux row stride divisible by 8: N = 56.
  for (const Mode& m : kModes)
    for (int t = 0; t < 4; ++t)
      run_gemm_case({m.dtype, m.compute, bool(t & 1), bool(t & 2), 37, 56, 71, GemmEpilogue::gelu_aux_bias});
  // f64: the plain product (linear's f64 bias goes through a fill kernel and beta = 1).
  for (int t = 0; t < 4; ++t) run_gemm_case({DType::f64, GemmCompute::f64, bool(t & 1), bool(t & 2), 37, 53, 71, GemmEpilogue::none});
}

TEST(CudaGemm, Gpt2Sizes) {
  SKIP_WITHOUT_CUDA();
  manual_seed(2);
  const int64_t R = 2048;  // rows: 2 sequences of 1024 tokens
  for (const Mode& m : kModes) {
    if (m.dtype == DType::f16) continue;
    run_gemm_case({m.dtype, m.compute, false, true, R, 2304, 768, GemmEpilogue::bias});           // qkv
    run_gemm_case({m.dtype, m.compute, false, true, R, 3072, 768, GemmEpilogue::gelu_aux_bias});  // fc + gelu
    run_gemm_case({m.dtype, m.compute, false, true, R, 768, 3072, GemmEpilogue::bias});           // proj
    run_gemm_case({m.dtype, m.compute, false, false, R, 768, 3072, GemmEpilogue::none});          // grad x = g·w
    run_gemm_case({m.dtype, m.compute, true, false, 768, 3072, R, GemmEpilogue::bgrad_a});       // grad w = gᵀ·x, grad b
    run_gemm_case({m.dtype, m.compute, false, true, 512, 50304, 768, GemmEpilogue::none});        // lm head
  }
}

TEST(CudaGemm, PlansAreCachedByShape) {
  SKIP_WITHOUT_CUDA();
  NoGradGuard ng;
  const Tensor a = dev(rnd({33, 17}, DType::f32)), b = dev(rnd({17, 9}, DType::f32));
  (void)matmul(a, b);
  const size_t n1 = cuda::gemm_plan_cache_size();
  (void)matmul(a, b);
  EXPECT_EQ(cuda::gemm_plan_cache_size(), n1) << "the same product must reuse its plan";
  (void)matmul(a, dev(rnd({17, 10}, DType::f32)));
  EXPECT_EQ(cuda::gemm_plan_cache_size(), n1 + 1) << "a new shape adds one plan";
}

// --- Note [GEMM tuning] ------------------------------------------------------------------------

// Sets the tuning for a scope, and puts the previous setting back.
struct TuneScope {
  cuda::GemmTuning before = cuda::gemm_tuning();
  explicit TuneScope(cuda::GemmTuning t) { cuda::set_gemm_tuning(std::move(t)); }
  ~TuneScope() { cuda::set_gemm_tuning(before); }
};

// Timed candidates write D, aux and the bias gradient before the kept call does: every dtype,
// transposition and epilogue still matches the f64 reference.
TEST(CudaGemmTune, TunedProductsMatchTheReference) {
  SKIP_WITHOUT_CUDA();
  manual_seed(11);
  TuneScope tune({true, ""});
  const int64_t timed = cuda::gemm_tune_stats().timed;
  for (const Mode& m : kModes)
    for (int t = 0; t < 4; ++t)
      for (GemmEpilogue e : {GemmEpilogue::none, GemmEpilogue::bias, GemmEpilogue::bgrad_a})
        run_gemm_case({m.dtype, m.compute, bool(t & 1), bool(t & 2), 37, 53, 71, e});
  const int64_t R = 2048;
  run_gemm_case({DType::bf16, GemmCompute::f16_f32, false, true, R, 3072, 768, GemmEpilogue::gelu_aux_bias});
  run_gemm_case({DType::bf16, GemmCompute::f16_f32, false, true, R, 768, 768, GemmEpilogue::bias});
  run_gemm_case({DType::bf16, GemmCompute::f16_f32, true, false, 768, 3072, R, GemmEpilogue::bgrad_a});
  run_gemm_case({DType::bf16, GemmCompute::f16_f32, false, true, 512, 50304, 768, GemmEpilogue::none});
  EXPECT_GT(cuda::gemm_tune_stats().timed, timed) << "nothing was timed";
}

// The weight gradient's form: bf16 operands accumulated into an f32 D (beta 1). The timed calls
// add into D again and again, so D is copied aside first and put back: one sum, not twenty.
TEST(CudaGemmTune, AccumulatingProductIsTimedOnACopy) {
  SKIP_WITHOUT_CUDA();
  NoGradGuard ng;
  manual_seed(12);
  TuneScope tune({true, ""});
  const int64_t N = 768, K = 1024, M = 640;  // dW[N, M] += dYᵀ[N, K] · X[K, M]
  const Tensor dy = rnd({K, N}, DType::bf16), x = rnd({K, M}, DType::bf16), c0 = rnd({N, M}, DType::f32);
  const Tensor dy_d = dev(dy), x_d = dev(x), c_d = dev(c0);
  GemmArgs g;
  g.dtype = DType::bf16;
  g.compute = GemmCompute::f16_f32;
  g.M = N;
  g.N = M;
  g.K = K;
  g.a = {dy_d.raw_data(), 1, N, 0};  // dYᵀ: a transposed view of [K, N]
  g.b = {x_d.raw_data(), M, 1, 0};
  g.c = c_d.raw_data();
  g.ldc = M;
  g.c_f32 = true;
  g.beta = 1;
  const int64_t timed = cuda::gemm_tune_stats().timed;
  const ExecContext& ctx = current_context(c_d.device());
  ctx.scratch->reset();
  cuda::gemm(g, cuda::stream_of(ctx), ctx.scratch->take(cuda::kGemmWorkspaceBytes));
  ASSERT_EQ(cuda::gemm_tune_stats().timed, timed + 1) << "the plan was not timed";
  const Tensor dy64 = f64(dy), x64 = f64(x);
  std::vector<double> ref = to_vector(add(matmul(transpose(dy64, 0, 1), x64), f64(c0)));
  std::vector<double> scale = to_vector(add(matmul(abs(transpose(dy64, 0, 1)), abs(x64)), abs(f64(c0))));
  EXPECT_TRUE(close("C + dYᵀ·X", hvec(c_d), ref, Tol{0, 0, 1e-5}, &scale));
}

// The choices go to the table file; a later setting (a later process) takes them from there and
// multiplies with the same algorithms: the same bits. A plan first used under a stream capture
// is not timed there (a capture cannot synchronise); its first call outside one is.
TEST(CudaGemmTune, ChoicesComeBackFromTheTableBitwiseAndCapturesAreNotTimed) {
  SKIP_WITHOUT_CUDA();
  NoGradGuard ng;
  manual_seed(13);
  const std::string file = (std::filesystem::temp_directory_path() /
                            ("blu_gemm_tune_" + std::to_string(::getpid()) + "/table.tsv")).string();
  std::filesystem::remove_all(std::filesystem::path(file).parent_path());
  const Tensor x = dev(rnd({4096, 768}, DType::bf16)), w = dev(rnd({2304, 768}, DType::bf16));
  const Tensor w2 = dev(rnd({768, 768}, DType::bf16)), w3 = dev(rnd({3072, 768}, DType::bf16));
  auto products = [&] {
    std::vector<Tensor> out;
    for (const Tensor& m : {w, w2, w3}) out.push_back(host(matmul(x, transpose(m, 0, 1))));
    return out;
  };
  std::vector<Tensor> first;
  int64_t timed = 0;
  {
    TuneScope tune({true, file});
    const cuda::GemmTuneStats s0 = cuda::gemm_tune_stats();
    first = products();
    const cuda::GemmTuneStats s1 = cuda::gemm_tune_stats();
    timed = s1.timed - s0.timed;
    ASSERT_GE(timed, 1);
    EXPECT_EQ(s1.from_table, s0.from_table);
    std::vector<std::string> warnings;
    EXPECT_EQ(int64_t(load_gemm_tune_table(file, &warnings).size()), timed);
    EXPECT_TRUE(warnings.empty()) << warnings[0];
  }
  {
    TuneScope tune({true, file});
    const cuda::GemmTuneStats s0 = cuda::gemm_tune_stats();
    const std::vector<Tensor> again = products();
    const cuda::GemmTuneStats s1 = cuda::gemm_tune_stats();
    EXPECT_EQ(s1.timed, s0.timed) << "a choice in the table was timed again";
    EXPECT_EQ(s1.from_table - s0.from_table, timed);
    for (size_t i = 0; i < first.size(); ++i)
      EXPECT_EQ(std::memcmp(first[i].raw_data(), again[i].raw_data(), first[i].nbytes()), 0) << "product " << i;
  }
  {
    TuneScope tune({true, ""});
    const Tensor y = empty({4096, 1536}, DType::bf16, kGPU), w4 = dev(rnd({1536, 768}, DType::bf16));
    const ExecContext& ctx = current_context(kGPU);
    const cudaStream_t stream = cuda::stream_of(ctx);
    const int64_t before = cuda::gemm_tune_stats().timed;
    GemmArgs g;
    g.dtype = DType::bf16;
    g.compute = GemmCompute::f16_f32;
    g.M = 4096;
    g.N = 1536;
    g.K = 768;
    g.a = {x.raw_data(), 768, 1, 0};
    g.b = {w4.raw_data(), 1, 768, 0};  // w4ᵀ
    g.c = y.raw_data();
    g.ldc = 1536;
    ctx.scratch->reset();
    void* ws = ctx.scratch->take(cuda::kGemmWorkspaceBytes);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cuda::gemm(g, stream, ws);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphDestroy(graph);
    EXPECT_EQ(cuda::gemm_tune_stats().timed, before) << "timed under a capture";
    cuda::gemm(g, stream, ws);
    EXPECT_EQ(cuda::gemm_tune_stats().timed, before + 1) << "not timed after the capture";
    const std::vector<double> got = hvec(y);
    const std::vector<double> ref = to_vector(matmul(f64(x), transpose(f64(w4), 0, 1)));
    const std::vector<double> scale = to_vector(matmul(abs(f64(x)), abs(transpose(f64(w4), 0, 1))));
    EXPECT_TRUE(close("X·W4ᵀ", got, ref, gemm_tol(DType::bf16, GemmCompute::f16_f32), &scale));
  }
  std::filesystem::remove_all(std::filesystem::path(file).parent_path());
}

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
