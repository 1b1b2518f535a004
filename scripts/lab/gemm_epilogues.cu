// What cuBLASLt's backward epilogues cost against the separate kernels BluTrain runs instead, at
// GPT-2 124M's bf16 step (B=16, T=1024: 16,384 rows).
//
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/gemm_epilogues scripts/lab/gemm_epilogues.cu -lcublasLt && /tmp/gemm_epilogues
//
// Per linear of a block, the weight gradient dW = dYᵀ·X (fp32 out) plain and with BGRADB (the bias
// gradient Σ_rows dY from the same GEMM, fp32); for the MLP's projection, the input gradient
// dH = dY·W (bf16 out) plain, with DGELU (dU = dH ⊙ gelu'(U), U the forward's GELU_AUX output) and
// with DGELU_BGRAD (and Σ_rows dU, c_fc's bias gradient). Each variant is the fastest of the
// heuristic's first eight candidates (5 warm-up calls, 30 timed), re-timed three times, its best.
// One JSON line each; compare with the separate kernels' times from an ncu trace of the step.
#include "cublaslt_lab.cuh"

#include <algorithm>
#include <cstdio>
#include <vector>

// The best of the first eight candidates: {ms, rank, candidates} (ms < 0: none ran).
struct Best {
  float ms;
  int rank, found;
  float first_ms;
};
Best best_of(const Problem& k) {
  std::vector<cublasLtMatmulHeuristicResult_t> res;
  const int found = heuristic(k, 8, res);
  if (found == 0) return {-1, -1, 0, -1};
  float best = 1e30f, first = -1;
  int rank = -1;
  for (int i = 0; i < found; ++i) {
    const float ms = time_algo(k, res[size_t(i)].algo, 5, 30);
    if (i == 0) first = ms;
    if (ms > 0 && ms < best) best = ms, rank = i;
  }
  if (rank < 0) return {-1, -1, found, first};
  best = 1e30f;
  for (int r = 0; r < 3; ++r) best = std::min(best, time_algo(k, res[size_t(rank)].algo, 5, 30));
  return {best, rank, found, first};
}

// One JSON line for a variant.
void report(const char* gemm, long M, long n, long k, const char* epilogue, const Best& b) {
  std::printf("{\"gemm\": \"%s\", \"out\": %ld, \"in\": %ld, \"epilogue\": \"%s\", \"candidates\": %d, "
              "\"first_ms\": %.4f, \"best_ms\": %.4f, \"rank\": %d, \"tflops\": %.0f}\n",
              gemm, n, k, epilogue, b.found, b.first_ms, b.ms, b.rank, b.ms > 0 ? 2.0 * M * n * k / b.ms / 1e9 : 0.0);
}

void set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void* v, size_t n) {
  LT(cublasLtMatmulDescSetAttribute(d, attr, v, n));
}

int main() {
  LT(cublasLtCreate(&handle));
  CK(cudaMalloc(&workspace, kWorkspace));
  const long M = 16384;
  const size_t most = size_t(M) * 3072;
  void *x, *dy, *w, *aux, *d32, *d16, *bgrad;
  CK(cudaMalloc(&x, most * 2));
  CK(cudaMalloc(&dy, most * 2));
  CK(cudaMalloc(&w, size_t(3072) * 3072 * 2));
  CK(cudaMalloc(&aux, most * 2));
  CK(cudaMalloc(&d32, size_t(3072) * 3072 * 4));
  CK(cudaMalloc(&d16, most * 2));
  CK(cudaMalloc(&bgrad, 3072 * 4));
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), most, 1);
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(dy), most, 2);
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w), size_t(3072) * 3072, 3);
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(aux), most, 4);
  CK(cudaDeviceSynchronize());

  const cublasOperation_t opn = CUBLAS_OP_N, opt = CUBLAS_OP_T;
  const cudaDataType_t f32 = CUDA_R_32F, bf16 = CUDA_R_16BF;
  // The block's linears: (out, in) of qkv, attention projection, c_fc, MLP projection.
  for (auto [n, k] : {std::pair{2304L, 768L}, {768L, 768L}, {3072L, 768L}, {768L, 3072L}}) {
    // dWᵀ[k, n] (column-major) = Xᵀ (k × M, ld k) · dY (n × M, ld n)ᵀ; Σ over M of dY: BGRADB.
    for (int bgrad_type = 0; bgrad_type < 3; ++bgrad_type) {  // none, BGRADB with fp32, with bf16
      Problem c{};
      LT(cublasLtMatmulDescCreate(&c.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      set(c.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opn, sizeof opn);
      set(c.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opt, sizeof opt);
      if (bgrad_type > 0) {
        const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BGRADB;
        set(c.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e);
        set(c.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bgrad, sizeof bgrad);
        set(c.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bgrad_type == 1 ? &f32 : &bf16, sizeof f32);
      }
      LT(cublasLtMatrixLayoutCreate(&c.la, bf16, k, M, k));
      LT(cublasLtMatrixLayoutCreate(&c.lb, bf16, n, M, n));
      LT(cublasLtMatrixLayoutCreate(&c.lc, f32, k, n, k));
      c.a = x, c.b = dy, c.c = d32;
      const Best b = best_of(c);
      report("wgrad", M, n, k, bgrad_type == 0 ? "none" : bgrad_type == 1 ? "bgradb_f32" : "bgradb_bf16", b);
      destroy(c);
    }
    if (k != 3072) continue;
    // dHᵀ[k, M] = Wᵀ... as BluTrain's dgrad: D (k × M, ld k) = W (k × n, ld k) · dYᵀ (n × M, ld n).
    struct V {
      const char* name;
      cublasLtEpilogue_t e;
      const cudaDataType_t* bt;
    };
    for (V v : {V{"none", CUBLASLT_EPILOGUE_DEFAULT, nullptr}, V{"dgelu", CUBLASLT_EPILOGUE_DGELU, nullptr},
                V{"dgelu_bgrad_f32", CUBLASLT_EPILOGUE_DGELU_BGRAD, &f32},
                V{"dgelu_bgrad_bf16", CUBLASLT_EPILOGUE_DGELU_BGRAD, &bf16}}) {
      Problem c{};
      LT(cublasLtMatmulDescCreate(&c.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      set(c.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opn, sizeof opn);
      set(c.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opn, sizeof opn);
      if (v.e != CUBLASLT_EPILOGUE_DEFAULT) {
        set(c.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &v.e, sizeof v.e);
        const int64_t ld = k;
        set(c.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
        set(c.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld);
        set(c.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &bf16, sizeof bf16);
        if (v.bt) {
          set(c.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bgrad, sizeof bgrad);
          set(c.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, v.bt, sizeof *v.bt);
        }
      }
      LT(cublasLtMatrixLayoutCreate(&c.la, bf16, k, n, k));
      LT(cublasLtMatrixLayoutCreate(&c.lb, bf16, n, M, n));
      LT(cublasLtMatrixLayoutCreate(&c.lc, bf16, k, M, k));
      c.a = w, c.b = dy, c.c = d16;
      const Best b = best_of(c);
      report("dgrad", M, n, k, v.name, b);
      destroy(c);
    }
  }
  return 0;
}
