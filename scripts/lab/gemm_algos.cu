// How much the step's GEMMs gain when cuBLASLt's candidate algorithms are timed instead of taking
// its heuristic's first choice (what BluTrain's gemm.cpp and PyTorch both take).
//
//   nvcc -O2 -arch=sm_90a -o /tmp/gemm_algos scripts/lab/gemm_algos.cu -lcublasLt -ldl && /tmp/gemm_algos [candidates [cold|sustained]]
//
// Per model and per GEMM of the bf16 step (the shapes of scripts/lab/gemm_shapes.py), with the
// layouts BluTrain's linear uses: forward Y = X W^T (bf16 out), input gradient dX = dY W (bf16 out),
// weight gradient dW += dY^T X (f32 out, beta 1). Each candidate runs 5 times, then 30 timed
// repetitions between CUDA events; one JSON line per GEMM: the heuristic's first choice, the
// fastest candidate and its rank, both in ms; a summary line per model weighted by the count per
// step.
//
// `sustained`: each candidate also runs back to back for ~0.4 s, timed over its last 0.3 s, with the
// board's power and SM clock sampled (NVML, loaded at run time) meanwhile. The GPU runs the step at
// its power limit, where a call's time is its energy over the limit's watts: the candidate that is
// fastest for 20 calls at full clock need not be the one that is fastest at the limit. Per GEMM: both
// timings of every candidate; per model: the step's GEMMs with the heuristic's choice, the short
// timing's choice and the sustained timing's choice, each timed sustained.
#include "cublaslt_lab.cuh"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdint>
#include <cstdio>
#include <string_view>
#include <cstdlib>
#include <vector>

struct Shape {
  const char* model;
  long m, n, k;
  int count;
};

enum Kind { kFwd, kDgrad, kWgrad, kFwdBias, kFwdGeluAux };
const char* kind_name(Kind k) {
  return k == kFwd ? "fwd" : k == kDgrad ? "dgrad" : k == kWgrad ? "wgrad" : k == kFwdBias ? "fwd+bias" : "fwd+gelu_aux";
}

// `/tmp/gemm_algos 32 cold`: every timed call starts with its operands out of L2.
static bool cold_l2 = false;
static void* flush;
static const size_t kFlush = size_t(256) << 20;
static bool sustained = false;

// NVML through dlopen (the driver ships libnvidia-ml.so.1; no header or link library needed).
struct Nvml {
  using Init = int (*)();
  using Handle = int (*)(unsigned, void**);
  using Power = int (*)(void*, unsigned*);
  using Clock = int (*)(void*, int, unsigned*);
  Power power = nullptr;
  Clock clock = nullptr;
  void* dev = nullptr;
  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) return;
    auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
    auto handle = reinterpret_cast<Handle>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    power = reinterpret_cast<Power>(dlsym(lib, "nvmlDeviceGetPowerUsage"));
    clock = reinterpret_cast<Clock>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    if (!init || !handle || !power || !clock || init() != 0 || handle(0, &dev) != 0) dev = nullptr;
  }
};
static Nvml nvml;

struct Sustained {
  float ms = -1, watts = 0, mhz = 0;
};

// `algo` back to back for ~0.4 s after a short timing `short_ms` sized the run; the last ~0.3 s
// timed, power (mW) and SM clock (NVML_CLOCK_SM = 1) sampled every 10 ms while they run.
Sustained time_sustained(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                         cublasLtMatrixLayout_t lc, const void* a, const void* b, void* c, float beta,
                         const cublasLtMatmulAlgo_t* algo, float short_ms) {
  Sustained out;
  if (short_ms <= 0) return out;
  const float alpha = 1;
  const int reps = std::max(40, int(300.0f / short_ms)), warm = reps / 3;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < warm; ++i)
    cublasLtMatmul(handle, desc, &alpha, a, la, b, lb, &beta, c, lc, c, lc, algo, workspace, kWorkspace, 0);
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i)
    cublasLtMatmul(handle, desc, &alpha, a, la, b, lb, &beta, c, lc, c, lc, algo, workspace, kWorkspace, 0);
  CK(cudaEventRecord(e1));
  double watts = 0, mhz = 0;
  int samples = 0;
  while (cudaEventQuery(e1) == cudaErrorNotReady) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    unsigned mw = 0, clk = 0;
    if (nvml.dev && cudaEventQuery(e0) == cudaSuccess && nvml.power(nvml.dev, &mw) == 0 &&
        nvml.clock(nvml.dev, 1, &clk) == 0) {
      watts += mw / 1000.0, mhz += clk;
      ++samples;
    }
  }
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  out.ms = ms / reps;
  if (samples) out.watts = float(watts / samples), out.mhz = float(mhz / samples);
  return out;
}

// Times `algo` (null: no algorithm given) in ms per call; negative when it fails to run.
float time_one(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
               cublasLtMatrixLayout_t lc, const void* a, const void* b, void* c, float beta,
               const cublasLtMatmulAlgo_t* algo) {
  const float alpha = 1;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i)
    if (cublasLtMatmul(handle, desc, &alpha, a, la, b, lb, &beta, c, lc, c, lc, algo, workspace, kWorkspace, 0) !=
        CUBLAS_STATUS_SUCCESS)
      return -1;
  const int reps = 30;
  float ms = 0;
  if (cold_l2) {  // each call timed alone after 256 MiB of writes have pushed its operands out of L2
    for (int i = 0; i < reps; ++i) {
      CK(cudaMemsetAsync(flush, i, kFlush));
      CK(cudaEventRecord(e0));
      cublasLtMatmul(handle, desc, &alpha, a, la, b, lb, &beta, c, lc, c, lc, algo, workspace, kWorkspace, 0);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float one = 0;
      CK(cudaEventElapsedTime(&one, e0, e1));
      ms += one;
    }
  } else {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i)
      cublasLtMatmul(handle, desc, &alpha, a, la, b, lb, &beta, c, lc, c, lc, algo, workspace, kWorkspace, 0);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms, e0, e1));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms / reps;
}

int main(int argc, char** argv) {
  const int want = argc > 1 ? std::atoi(argv[1]) : 32;
  cold_l2 = argc > 2 && std::string_view(argv[2]) == "cold";
  sustained = argc > 2 && std::string_view(argv[2]) == "sustained";
  CK(cudaMalloc(&flush, kFlush));
  LT(cublasLtCreate(&handle));
  CK(cudaMalloc(&workspace, kWorkspace));
  std::vector<Shape> shapes;
  // GPT-2 124M, B=16, T=1024: qkv, proj, fc, fc proj (12 layers), the tied head.
  for (auto [n, k] : {std::pair{2304L, 768L}, {768L, 768L}, {3072L, 768L}, {768L, 3072L}})
    shapes.push_back({"gpt2", 16384, n, k, 12});
  shapes.push_back({"gpt2", 16384, 50304, 768, 1});
  // llama-250m, B=8, T=1024: qkv, o, gate+up, down (16 layers), the head.
  for (auto [n, k] : {std::pair{1536L, 1024L}, {1024L, 1024L}, {5632L, 1024L}, {1024L, 2816L}})
    shapes.push_back({"llama", 8192, n, k, 16});
  shapes.push_back({"llama", 8192, 32000, 1024, 1});

  size_t most = 0;
  for (const Shape& s : shapes) most = std::max({most, size_t(s.m * s.n), size_t(s.m * s.k), size_t(s.n * s.k)});
  void *x, *y, *w;
  CK(cudaMalloc(&x, most * 2));
  CK(cudaMalloc(&y, most * 4));
  CK(cudaMalloc(&w, most * 4));
  // Random values in [-1, 1): a tensor core's power, and so its clock, depends on the bits.
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), most, 1);
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(y), most * 2, 2);
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w), most * 2, 3);
  CK(cudaDeviceSynchronize());

  const char* model = "";
  double first_total = 0, best_total = 0;
  double sus_first = 0, sus_short_pick = 0, sus_pick = 0;  // sustained ms per step, by how the candidate was picked
  auto flush = [&] {
    if (*model)
      std::printf("{\"model\": \"%s\", \"heuristic_ms_per_step\": %.3f, \"best_ms_per_step\": %.3f, \"saved_ms\": %.3f}\n",
                  model, first_total, best_total, first_total - best_total);
    if (*model && sustained)
      std::printf("{\"model\": \"%s\", \"sustained_ms_per_step\": {\"heuristic\": %.3f, \"short_pick\": %.3f, "
                  "\"sustained_pick\": %.3f}}\n",
                  model, sus_first, sus_short_pick, sus_pick);
    first_total = best_total = sus_first = sus_short_pick = sus_pick = 0;
  };
  for (const Shape& s : shapes) {
    if (std::string_view(model) != s.model) {
      flush();
      model = s.model;
    }
    // GPT-2's forward GEMMs carry the bias (and c_fc the GELU with its aux output) as epilogues.
    std::vector<Kind> kinds = {kFwd, kDgrad, kWgrad};
    if (std::string_view(s.model) == "gpt2" && s.n != 50304) kinds.push_back(s.n == 3072 ? kFwdGeluAux : kFwdBias);
    for (Kind kind : kinds) {
      // Column-major views of the row-major operands (see the header).
      cublasOperation_t ta, tb;
      long rows_a, cols_a, lda, rows_b, cols_b, ldb, rows_c, cols_c;
      const void *a, *b;
      void* c = y;
      cudaDataType_t ct = CUDA_R_16BF;
      float beta = 0;
      if (kind == kFwd || kind == kFwdBias || kind == kFwdGeluAux) {  // Y^T[N,M] = W^T^T · X^T: A = W (K x N, ld K) op T, B = X (K x M, ld K)
        ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        rows_a = s.k, cols_a = s.n, lda = s.k, rows_b = s.k, cols_b = s.m, ldb = s.k, rows_c = s.n, cols_c = s.m;
        a = w, b = x;
      } else if (kind == kDgrad) {  // dX^T[K,M] = W^T (K x N, ld K) · dY^T (N x M, ld N)
        ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
        rows_a = s.k, cols_a = s.n, lda = s.k, rows_b = s.n, cols_b = s.m, ldb = s.n, rows_c = s.k, cols_c = s.m;
        a = w, b = y;
      } else {  // dW^T[K,N] = X^T (K x M, ld K) · dY (N x M, ld N)^T, accumulated in f32
        ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
        rows_a = s.k, cols_a = s.m, lda = s.k, rows_b = s.n, cols_b = s.m, ldb = s.n, rows_c = s.k, cols_c = s.n;
        a = x, b = y;
        c = w;
        ct = CUDA_R_32F;
        beta = 1;
      }
      cublasLtMatmulDesc_t desc;
      LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      if (kind == kFwdBias || kind == kFwdGeluAux) {
        const cublasLtEpilogue_t epi = kind == kFwdBias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        const cudaDataType_t bt = CUDA_R_16BF;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
        const void* bias = w;  // any n bf16 values
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
        if (kind == kFwdGeluAux) {
          const void* aux = static_cast<char*>(y) + size_t(s.m * s.n) * 2;
          const int64_t ld = s.n;
          LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
          LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
          LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &bt, sizeof bt));
        }
      }
      cublasLtMatrixLayout_t la, lb, lc;
      LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, rows_a, cols_a, lda));
      LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, rows_b, cols_b, ldb));
      LT(cublasLtMatrixLayoutCreate(&lc, ct, rows_c, cols_c, rows_c));
      std::vector<cublasLtMatmulHeuristicResult_t> res;
      Problem prob{desc, la, lb, lc, a, b, c};
      const int found = heuristic(prob, want, res);
      float first = -1, best = 1e30f;
      int best_rank = -1;
      std::vector<float> short_ms(static_cast<size_t>(found), -1.0f);
      for (int i = 0; i < found; ++i) {
        const float ms = time_one(desc, la, lb, lc, a, b, c, beta, &res[size_t(i)].algo);
        short_ms[size_t(i)] = ms;
        if (i == 0) first = ms;
        if (ms > 0 && ms < best) best = ms, best_rank = i;
      }
      if (sustained && found > 0) {
        std::vector<Sustained> sus(static_cast<size_t>(found));
        int pick = -1;
        for (int i = 0; i < found; ++i) {
          sus[size_t(i)] = time_sustained(desc, la, lb, lc, a, b, c, beta, &res[size_t(i)].algo, short_ms[size_t(i)]);
          if (sus[size_t(i)].ms > 0 && (pick < 0 || sus[size_t(i)].ms < sus[size_t(pick)].ms)) pick = i;
        }
        std::printf("{\"model\": \"%s\", \"N\": %ld, \"K\": %ld, \"kind\": \"%s\", \"short_pick\": %d, "
                    "\"sustained_pick\": %d, \"candidates\": [",
                    s.model, s.n, s.k, kind_name(kind), best_rank, pick);
        for (int i = 0; i < found; ++i)
          std::printf("%s[%.4f, %.4f, %.0f, %.0f]", i ? ", " : "", short_ms[size_t(i)], sus[size_t(i)].ms,
                      sus[size_t(i)].watts, sus[size_t(i)].mhz);
        std::printf("]}\n");
        if (kind != kFwdBias && kind != kFwdGeluAux && pick >= 0 && best_rank >= 0) {
          sus_first += double(sus[0].ms) * s.count;
          sus_short_pick += double(sus[size_t(best_rank)].ms) * s.count;
          sus_pick += double(sus[size_t(pick)].ms) * s.count;
        }
      }
      // The first choice and the fastest again, alternated three times, each its best: picking the
      // least of eight noisy timings favours the fastest by its noise.
      if (best_rank > 0) {
        first = best = 1e30f;
        for (int round = 0; round < 3; ++round) {
          first = std::min(first, time_one(desc, la, lb, lc, a, b, c, beta, &res[0].algo));
          best = std::min(best, time_one(desc, la, lb, lc, a, b, c, beta, &res[size_t(best_rank)].algo));
        }
      }
      const double flop = 2.0 * double(s.m) * double(s.n) * double(s.k);
      std::printf("{\"model\": \"%s\", \"M\": %ld, \"N\": %ld, \"K\": %ld, \"kind\": \"%s\", \"count\": %d, "
                  "\"candidates\": %d, \"heuristic_ms\": %.4f, \"best_ms\": %.4f, \"best_rank\": %d, "
                  "\"heuristic_tflops\": %.0f, \"best_tflops\": %.0f}\n",
                  s.model, s.m, s.n, s.k, kind_name(kind), s.count, found, first, best, best_rank,
                  flop / first / 1e9, flop / best / 1e9);
      if (kind != kFwdBias && kind != kFwdGeluAux) {  // the plain forward counts in the totals
        first_total += double(first) * s.count;
        best_total += double(best) * s.count;
      }
      destroy(prob);
    }
  }
  flush();
  return 0;
}
