// backend/cuda/gemm: every matrix product of the CUDA backend, through cuBLASLt. Row-major
// C[M, N] = A[M, K] · B[K, N] (+ epilogue), either operand transposed through its strides,
// batched with any batch stride (0 broadcasts), in one of four numeric modes:
//   f32 IEEE (CUBLAS_COMPUTE_32F), f32 TF32 (CUBLAS_COMPUTE_32F_FAST_TF32), bf16/f16 inputs and
//   output with fp32 accumulation, f64 (CUBLAS_COMPUTE_64F).
// Epilogues: bias add, bias + GELU (tanh approximation, cuBLASLt's), the latter optionally saving
// the pre-activation (GELU_AUX), and bias gradients (the sum over K of A or of B).
// Row-major ↔ cuBLAS: a row-major [M, N] matrix with row stride ld is the column-major [N, M]
// matrix with leading dimension ld, so C = A·B is computed as the column-major Cᵀ = Bᵀ·Aᵀ: cuBLAS
// m = N, n = M, its "A" is our B and its "B" our A (so a bias over our N columns is cuBLAS's
// bias over D's rows, and our bgrad_a is cuBLAS's BGRADB).
// Descriptors, layouts and the heuristic's choice are cached per thread by everything that
// determines them (shapes, strides, dtypes, transposes, epilogue, compute mode, pointer
// alignment); pointers are set per call.
//
// Note [GEMM tuning]
// cuBLASLt's heuristic ranks candidate algorithms without running them, and its first choice is
// what a plan takes. On the step's own shapes another of its first eight candidates is often
// faster — by up to 17% on GPT-2's head and 10-15% on its 768-wide projections (H200, bf16,
// scripts/lab/gemm_algos.cu: 1.2 ms of GPT-2 124M's 17.3 ms of GEMMs per step, 0.6 of
// llama-250m's 14.1). With tuning on (GemmTuning, BLU_GEMM_TUNE=1, `--gemm-tune`), a plan's first
// call on a stream that is not being captured times each candidate on the call's own operands (a D
// that the product reads is copied aside and put back) and keeps the fastest, unless the
// heuristic's choice is within 2% of it. That call synchronises the host with the stream once.
// Which candidate wins a timing can differ between processes, and with it the bits of the result:
// so the choices go to a table file (backend/gemm_tune_table.h) keyed by the GPU, cuBLASLt's
// version and the plan's key, and a later process takes its choices from there — a resumed run
// multiplies with the algorithms of the run it resumes. Off, every plan takes the heuristic's
// first choice, the same in every process on the same GPU and library.
// Depends on backend/cuda/runtime, backend/cuda/gemm_tune, core/dtype. Keep: launches on the
// stream it is given, never synchronises (but for a tuned plan's first call), uses the
// kGemmWorkspaceBytes of cuBLASLt workspace it is given (a slice of the call's Workspace, so two
// streams never share one — Note [Execution context]); no
// algorithm → BLU_CHECK, except a bias-gradient epilogue, which falls back (logged once) to a
// plain gemm and a separate deterministic sum.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "blu/core/dtype.h"

namespace blu::cuda {

enum class GemmCompute {
  f32_ieee,  // f32 operands, exact fp32 products and sums
  f32_tf32,  // f32 operands rounded to TF32 in the tensor cores, fp32 sums
  f16_f32,   // bf16 or f16 operands (the dtype says which), fp32 sums
  f64,       // f64 operands
};

enum class GemmEpilogue {
  none,
  bias,           // C[i, j] += bias[j]
  gelu_bias,      // C = gelu_tanh(A·B + bias)
  gelu_aux_bias,  // as gelu_bias, and aux[i, j] = (A·B + bias)[i, j] (aux_ld % 8 == 0)
  bgrad_a,        // plain product, and bias_grad[i] = Σ_k A[i, k]   (length M)
  bgrad_b,        // plain product, and bias_grad[j] = Σ_k B[k, j]   (length N)
};
const char* gemm_epilogue_name(GemmEpilogue e);

// An operand: element (r, c) of batch b at ptr + b*batch_stride + r*row_stride + c*col_stride
// (elements). One of the two matrix strides must be 1 (the other >= the extent it spans); a
// matrix with a single row or column may have any stride along it.
struct GemmOperand {
  const void* ptr = nullptr;
  int64_t row_stride = 0, col_stride = 1, batch_stride = 0;
};

struct GemmArgs {
  DType dtype = DType::f32;  // of A, B, C and the bias / bias gradient / aux
  GemmCompute compute = GemmCompute::f32_ieee;
  int64_t M = 0, N = 0, K = 0, batch = 1;
  GemmOperand a, b;
  void* c = nullptr;  // row-major, row stride ldc (>= N), batch stride c_batch_stride
  const void* c_in = nullptr;  // the C that beta scales, laid out as c (null: c itself; D is always c)
  int64_t ldc = 0, c_batch_stride = 0;
  bool c_f32 = false;  // C in f32 while A and B are bf16/f16 (the fp32 sums stored unrounded; plain epilogue only)
  float alpha = 1, beta = 0;  // C = alpha·A·B + beta·C (beta != 0 reads C first)
  GemmEpilogue epilogue = GemmEpilogue::none;
  const void* bias = nullptr;  // bias / gelu_*: length N, contiguous; not batched
  void* bias_grad = nullptr;   // bgrad_*: the bias gradient (batch must be 1)
  void* aux = nullptr;         // gelu_aux_bias: row-major [M, N] pre-activation, row stride aux_ld
  int64_t aux_ld = 0;
};

// The compute mode for operands of `dtype` under the process-wide matmul precision
// (core/precision.h): f32 → IEEE or TF32; bf16/f16 → f16_f32; f64 → f64.
GemmCompute default_gemm_compute(DType dtype);

// The cuBLASLt workspace every product gets (the heuristic's algorithms may use up to this much).
inline constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

// Enqueues the product on `stream`, with `workspace` (kGemmWorkspaceBytes, 256-byte aligned,
// used by nothing else on another stream) as cuBLASLt's workspace. M, N or K may be 0 (K == 0:
// C = beta·C, plus the bias if any, written by a small kernel — see linalg.cu). BLU_CHECK on
// unsupported layouts.
void gemm(const GemmArgs& args, cudaStream_t stream, void* workspace);

// Whether an operand of rows × cols with these strides can go to cuBLAS as it is (one unit
// stride, the other spanning the extent); otherwise it must be packed first.
bool gemm_operand_ok(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride);

// Number of cached plans on this thread (tests check the cache is hit).
size_t gemm_plan_cache_size();

// Note [GEMM tuning]. `file`: the table ("" keeps choices in this process only).
struct GemmTuning {
  bool on = false;
  std::string file;
  bool log = false;  // one line on stderr per timed plan: its key, the kept candidate, both times
};
// Until set_gemm_tuning: BLU_GEMM_TUNE (1/on or 0/off, default off), BLU_GEMM_TUNE_FILE (default
// default_gemm_tune_file(); "none": no file) and BLU_GEMM_TUNE_LOG=1. BLU_CHECK on another
// BLU_GEMM_TUNE value.
GemmTuning gemm_tuning();
// Applies to plans made from now on (each thread's plan cache is dropped).
void set_gemm_tuning(GemmTuning t);
struct GemmTuneStats {
  int64_t timed = 0;       // plans whose candidates were timed
  int64_t changed = 0;     // of those, plans that took another than the heuristic's first choice
  int64_t from_table = 0;  // plans that took a choice from the table file
  int64_t skipped = 0;     // plans left with the heuristic's choice (no memory to copy D aside)
};
GemmTuneStats gemm_tune_stats();

// Kernels in linalg.cu used by gemm and the op kernels.
// dst[r, c] (row-major, row stride ldc, `batch` matrices of batch stride bs) = bias[c] or 0, plus
// add[r, c] when `add` is given (laid out as dst).
void fill_rows_launch(DType dtype, void* dst, int64_t batch, int64_t rows, int64_t cols, int64_t ldc, int64_t bs,
                      const void* bias, const void* add, cudaStream_t stream);
// Packs a strided tensor (rank <= 8) into contiguous row-major memory: dst has numel elements.
void pack_strided_launch(size_t elem_size, const void* src, void* dst, int rank, const int64_t* shape,
                         const int64_t* strides, cudaStream_t stream);
// dst[j] = Σ_i src[i*sum_stride + j*out_stride], i < n_sum, j < n_out: deterministic (one thread
// per output, fixed order), fp32 sums (f64 for f64); dst contiguous, in `dtype` or (out_f32, a
// 16-bit dtype) f32. The bias-gradient fallback.
void strided_sum_launch(DType dtype, const void* src, int64_t n_sum, int64_t n_out, int64_t sum_stride,
                        int64_t out_stride, void* dst, bool out_f32, cudaStream_t stream);

}  // namespace blu::cuda
