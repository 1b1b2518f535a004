// GPU tests of the CUDA gemm (backend/cuda/gemm.h, cuBLASLt): every dtype, numeric mode,
// transposition and epilogue at odd sizes and GPT-2's sizes against an f64 reference on the host,
// the plan cache, and GEMM tuning (Note [GEMM tuning]): tuned products against the reference, an
// accumulating product timed on a copy, choices read back from the table file bitwise, no timing
// under a stream capture. Every test skips when no CUDA device is present.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "blu/backend/cuda/gemm.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/backend/gemm_tune_table.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/linalg.h"
#include "blu/ops/view.h"
#include "cuda/close_check.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using cuda::GemmArgs;
using cuda::GemmCompute;
using cuda::GemmEpilogue;
using test::close;
using test::dev;
using test::f64;
using test::gemm_tol;
using test::host;
using test::hvec;
using test::kGPU;
using test::rnd;
using test::Tol;

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

}  // namespace
}  // namespace blu
