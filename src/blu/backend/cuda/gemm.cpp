// cuBLASLt plans: descriptors, layouts and the heuristic's algorithm, cached per thread by the
// key of everything they depend on. See gemm.h for the row-major ↔ column-major mapping.
#include "blu/backend/cuda/gemm.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "blu/backend/cuda/gemm_tune.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/core/cuda/runtime.h"
#include "blu/core/precision.h"

namespace blu::cuda {

const char* gemm_epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::none: return "none";
    case GemmEpilogue::bias: return "bias";
    case GemmEpilogue::gelu_bias: return "gelu_bias";
    case GemmEpilogue::gelu_aux_bias: return "gelu_aux_bias";
    case GemmEpilogue::bgrad_a: return "bgrad_a";
    case GemmEpilogue::bgrad_b: return "bgrad_b";
  }
  return "?";
}

GemmCompute default_gemm_compute(DType dtype) {
  switch (dtype) {
    case DType::f32: return matmul_precision() == MatmulPrecision::tf32 ? GemmCompute::f32_tf32 : GemmCompute::f32_ieee;
    case DType::f64: return GemmCompute::f64;
    case DType::bf16:
    case DType::f16: return GemmCompute::f16_f32;
    default: BLU_CHECK(false, "gemm: expected a floating dtype, got ", dtype);
  }
  return GemmCompute::f32_ieee;
}

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f64: return CUDA_R_64F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: BLU_CHECK(false, "gemm: no cuBLAS type for ", t);
  }
  return CUDA_R_32F;
}

// How cuBLAS reads one of our row-major operands of rows × cols: as the column-major cols × rows
// matrix (op N) when its column stride is 1, or as the column-major rows × cols matrix
// transposed (op T) when its row stride is 1. (Single rows or columns fit both; any stride along
// a size-1 dim is unused.)
struct OperandLayout {
  bool ok = false;
  bool trans = false;       // cuBLAS op T
  uint64_t cm_rows = 0, cm_cols = 0;  // the column-major matrix cuBLAS is given
  int64_t ld = 0;
};
OperandLayout operand_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  const int64_t r1 = std::max<int64_t>(rows, 1), c1 = std::max<int64_t>(cols, 1);
  if ((cols == 1 || cs == 1) && (rows == 1 || rs >= c1))
    return {true, false, uint64_t(c1), uint64_t(r1), rows == 1 ? c1 : rs};
  if ((rows == 1 || rs == 1) && (cols == 1 || cs >= r1))
    return {true, true, uint64_t(r1), uint64_t(c1), cols == 1 ? r1 : cs};
  return {};
}

int alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 16 && (u % uintptr_t(a * 2)) == 0) a *= 2;
  return p ? a : 16;
}

struct PlanKey {
  int device;
  DType dtype;
  bool c_f32;
  GemmCompute compute;
  GemmEpilogue epilogue;
  bool trans_a, trans_b, beta_nonzero;
  int64_t M, N, K, batch, lda, ldb, ldc, sa, sb, sc, aux_ld;
  int align_a, align_b, align_c, align_bias, align_aux;
  bool operator==(const PlanKey&) const = default;
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 1469598103934665603ull;
    auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(uint64_t(k.device));
    mix(uint64_t(k.dtype) | uint64_t(k.compute) << 8 | uint64_t(k.epilogue) << 16 | uint64_t(k.trans_a) << 24 |
        uint64_t(k.trans_b) << 25 | uint64_t(k.beta_nonzero) << 26 | uint64_t(k.c_f32) << 27);
    for (int64_t v : {k.M, k.N, k.K, k.batch, k.lda, k.ldb, k.ldc, k.sa, k.sb, k.sc, k.aux_ld}) mix(uint64_t(v));
    mix(uint64_t(k.align_a) | uint64_t(k.align_b) << 8 | uint64_t(k.align_c) << 16 | uint64_t(k.align_bias) << 24 |
        uint64_t(k.align_aux) << 32);
    return h;
  }
};

// Owns its cuBLASLt objects (move-only by unique_ptr in the cache).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLAS A (= our B), B (= our A), C/D
  cublasLtMatmulAlgo_t algo{};
  bool have_algo = false;
  // Note [GEMM tuning]: the heuristic's candidates (first choice first) until the plan is tuned.
  std::vector<cublasLtMatmulAlgo_t> candidates;
  bool tuned = true;
  std::string table_key;
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (la) cublaslt().MatrixLayoutDestroy(la);
    if (lb) cublaslt().MatrixLayoutDestroy(lb);
    if (lc) cublaslt().MatrixLayoutDestroy(lc);
    if (desc) cublaslt().MatmulDescDestroy(desc);
  }
};

cublasLtMatrixLayout_t make_layout(cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, int64_t batch,
                                   int64_t batch_stride) {
  cublasLtMatrixLayout_t l = nullptr;
  BLU_CUBLAS_CHECK(cublaslt().MatrixLayoutCreate(&l, t, rows, cols, ld));
  if (batch > 1) {
    const int32_t count = int32_t(batch);
    BLU_CUBLAS_CHECK(cublaslt().MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    BLU_CUBLAS_CHECK(cublaslt().MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
                                                      sizeof(batch_stride)));
  }
  return l;
}

cublasLtEpilogue_t lt_epilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::gelu_bias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case GemmEpilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::bgrad_a: return CUBLASLT_EPILOGUE_BGRADB;  // our A is cuBLAS's B
    case GemmEpilogue::bgrad_b: return CUBLASLT_EPILOGUE_BGRADA;  // our B is cuBLAS's A
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

constexpr size_t kTuneCandidates = 8;  // Note [GEMM tuning]

// The plan's line in the table: the GPU's name, cuBLASLt's version, and the key's every field but
// the device's index.
std::string table_key(const PlanKey& k) {
  static thread_local std::string device;
  static thread_local int device_of = -1;
  if (device_of != k.device) {
    device = device_name(k.device);
    std::replace(device.begin(), device.end(), '\t', ' ');  // the table's field separator
    device_of = k.device;
  }
  char fields[512];
  std::snprintf(fields, sizeof fields,
                " lt%zu dt%d c32%d cm%d ep%d t%d%d b%d M%lld N%lld K%lld B%lld ld%lld,%lld,%lld s%lld,%lld,%lld "
                "aux%lld al%d,%d,%d,%d,%d",
                cublaslt().GetVersion(), int(k.dtype), int(k.c_f32), int(k.compute), int(k.epilogue), int(k.trans_a),
                int(k.trans_b), int(k.beta_nonzero), (long long)k.M, (long long)k.N, (long long)k.K,
                (long long)k.batch, (long long)k.lda, (long long)k.ldb, (long long)k.ldc, (long long)k.sa,
                (long long)k.sb, (long long)k.sc, (long long)k.aux_ld, k.align_a, k.align_b, k.align_c, k.align_bias,
                k.align_aux);
  return device + fields;
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  BLU_CUBLAS_CHECK(cublaslt().MatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

std::unique_ptr<Plan> make_plan(const PlanKey& k, const GemmArgs& g, const OperandLayout& lA, const OperandLayout& lB) {
  auto p = std::make_unique<Plan>();
  const cudaDataType_t t = cuda_type(g.dtype);
  cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  switch (g.compute) {
    case GemmCompute::f32_ieee: ct = CUBLAS_COMPUTE_32F; break;
    case GemmCompute::f32_tf32: ct = CUBLAS_COMPUTE_32F_FAST_TF32; break;
    case GemmCompute::f16_f32: ct = CUBLAS_COMPUTE_32F; break;
    case GemmCompute::f64: ct = CUBLAS_COMPUTE_64F; scale = CUDA_R_64F; break;
  }
  BLU_CUBLAS_CHECK(cublaslt().MatmulDescCreate(&p->desc, ct, scale));
  // cuBLAS A is our B (lB), cuBLAS B is our A (lA).
  const int32_t opa = lB.trans ? CUBLAS_OP_T : CUBLAS_OP_N, opb = lA.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_desc(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, opa);
  set_desc(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, opb);
  const uint32_t epi = lt_epilogue(g.epilogue);
  set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
  if (g.epilogue != GemmEpilogue::none) {
    const int32_t bt = int32_t(t);
    set_desc(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bt);
    const void* bp = g.epilogue == GemmEpilogue::bgrad_a || g.epilogue == GemmEpilogue::bgrad_b ? g.bias_grad : g.bias;
    set_desc(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bp);
  }
  if (g.epilogue == GemmEpilogue::gelu_aux_bias) {
    set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(g.aux));
    set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
    const int32_t at = int32_t(t);
    set_desc(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, at);
  }
  p->la = make_layout(t, lB.cm_rows, lB.cm_cols, lB.ld, g.batch, g.b.batch_stride);
  p->lb = make_layout(t, lA.cm_rows, lA.cm_cols, lA.ld, g.batch, g.a.batch_stride);
  p->lc = make_layout(g.c_f32 ? CUDA_R_32F : t, uint64_t(g.N), uint64_t(g.M), g.ldc, g.batch, g.c_batch_stride);

  cublasLtMatmulPreference_t pref = nullptr;
  BLU_CUBLAS_CHECK(cublaslt().MatmulPreferenceCreate(&pref));
  const uint64_t ws64 = kGemmWorkspaceBytes;
  BLU_CUBLAS_CHECK(
      cublaslt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws64, sizeof(ws64)));
  const uint32_t al_a = uint32_t(k.align_b), al_b = uint32_t(k.align_a), al_c = uint32_t(k.align_c);
  BLU_CUBLAS_CHECK(
      cublaslt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  BLU_CUBLAS_CHECK(
      cublaslt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  BLU_CUBLAS_CHECK(
      cublaslt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  BLU_CUBLAS_CHECK(
      cublaslt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  const bool tune = gemm_tuning().on;
  std::vector<cublasLtMatmulHeuristicResult_t> res(tune ? kTuneCandidates : 1);
  int found = 0;
  const cublasStatus_t st = cublaslt().MatmulAlgoGetHeuristic(cublaslt_handle(), p->desc, p->la, p->lb, p->lc, p->lc,
                                                              pref, int(res.size()), res.data(), &found);
  cublaslt().MatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    p->algo = res[0].algo;
    p->have_algo = true;
  }
  if (tune && p->have_algo) {
    p->table_key = table_key(k);
    TunedGemm t;
    if (gemm_tune_find(p->table_key, t)) {
      cublasLtMatmulAlgo_t algo{};
      static_assert(sizeof(algo.data) == sizeof(t.algo));
      std::memcpy(algo.data, t.algo.data(), sizeof(algo.data));
      cublasLtMatmulHeuristicResult_t check{};
      if (cublaslt().MatmulAlgoCheck(cublaslt_handle(), p->desc, p->la, p->lb, p->lc, p->lc, &algo, &check) ==
              CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= kGemmWorkspaceBytes) {
        p->algo = algo;
        gemm_tune_count(&GemmTuneStats::from_table);
        return p;
      }
    }
    for (int i = 0; i < found; ++i) p->candidates.push_back(res[size_t(i)].algo);
    p->tuned = false;
  }
  return p;
}

// Note [GEMM tuning]: times the plan's candidates with this call's operands and arguments on
// `stream`, and keeps the fastest (the first choice unless another is 2% faster). Under a stream
// capture nothing is timed; a later call tunes the plan.
void tune_plan(Plan& p, const GemmArgs& g, const void* alpha, const void* beta, cudaStream_t stream,
               void* workspace) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  BLU_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return;
  p.tuned = true;
  const size_t n = p.candidates.size();
  if (n < 2) return;
  const void* c_in = g.c_in ? g.c_in : g.c;
  // The timed calls write D again and again: a D that the product also reads goes aside first.
  const size_t c_bytes = size_t((g.batch - 1) * g.c_batch_stride + (g.M - 1) * g.ldc + g.N) *
                         (g.c_f32 ? sizeof(float) : dtype_size(g.dtype));
  void* saved = nullptr;
  if (g.beta != 0 && c_in == g.c) {
    if (cudaMallocAsync(&saved, c_bytes, stream) != cudaSuccess) {
      (void)cudaGetLastError();
      gemm_tune_count(&GemmTuneStats::skipped);
      return;
    }
    BLU_CUDA_CHECK(cudaMemcpyAsync(saved, g.c, c_bytes, cudaMemcpyDeviceToDevice, stream));
  }
  auto call = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublaslt().Matmul(cublaslt_handle(), p.desc, alpha, g.b.ptr, p.la, g.a.ptr, p.lb, beta, c_in, p.lc, g.c,
                             p.lc, &algo, workspace, kGemmWorkspaceBytes, stream);
  };
  cudaEvent_t start = nullptr, stop = nullptr;
  BLU_CUDA_CHECK(cudaEventCreate(&start));
  BLU_CUDA_CHECK(cudaEventCreate(&stop));
  constexpr int kWarm = 2, kReps = 10, kRounds = 2;
  std::vector<float> ms(n, -1);  // each candidate's best round; negative: it did not run
  for (size_t i = 0; i < n; ++i) {
    bool ok = true;
    for (int w = 0; w < kWarm && ok; ++w) ok = call(p.candidates[i]) == CUBLAS_STATUS_SUCCESS;
    if (ok) ms[i] = 1e30f;
  }
  for (int round = 0; round < kRounds; ++round)
    for (size_t i = 0; i < n; ++i) {
      if (ms[i] < 0) continue;
      BLU_CUDA_CHECK(cudaEventRecord(start, stream));
      for (int r = 0; r < kReps; ++r) (void)call(p.candidates[i]);
      BLU_CUDA_CHECK(cudaEventRecord(stop, stream));
      BLU_CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      BLU_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      ms[i] = std::min(ms[i], t / kReps);
    }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (saved) {
    BLU_CUDA_CHECK(cudaMemcpyAsync(g.c, saved, c_bytes, cudaMemcpyDeviceToDevice, stream));
    BLU_CUDA_CHECK(cudaFreeAsync(saved, stream));
  }
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (ms[i] >= 0 && (ms[best] < 0 || ms[i] < ms[best])) best = i;
  if (ms[0] >= 0 && ms[best] > 0.98f * ms[0]) best = 0;
  p.algo = p.candidates[best];
  p.candidates.clear();
  gemm_tune_count(&GemmTuneStats::timed);
  if (best != 0) gemm_tune_count(&GemmTuneStats::changed);
  TunedGemm t;
  std::memcpy(t.algo.data(), p.algo.data, sizeof(p.algo.data));
  t.ms = ms[best];
  gemm_tune_store(p.table_key, t);
  if (gemm_tuning().log)
    std::fprintf(stderr, "blu: gemm tuning: %s: candidate %zu of %zu, %.4f ms against %.4f for the first choice\n",
                 p.table_key.c_str(), best + 1, n, double(ms[best]), double(ms[0]));
}

using PlanCache = std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash>;
PlanCache& plan_cache() {
  // Per thread: the plan's descriptor gets per-call pointers written into it. Dropped when the
  // tuning setting changes.
  thread_local PlanCache cache;
  thread_local uint64_t generation = 0;
  const uint64_t now = gemm_tuning_generation();
  if (generation != now) {
    cache.clear();
    generation = now;
  }
  return cache;
}

// The product without the bias gradient, then the gradient by a separate deterministic sum: used
// when cuBLASLt has no algorithm for a BGRAD epilogue (logged once).
void gemm_bgrad_fallback(const GemmArgs& g, cudaStream_t stream, void* workspace) {
  static bool logged = false;
  if (!logged) {
    std::fprintf(stderr, "blu: cuBLASLt has no algorithm for a bias-gradient epilogue (%s, dtype %s, M=%lld N=%lld "
                 "K=%lld); using a plain gemm and a separate sum kernel\n",
                 gemm_epilogue_name(g.epilogue), std::string(dtype_name(g.dtype)).c_str(), (long long)g.M,
                 (long long)g.N, (long long)g.K);
    logged = true;
  }
  GemmArgs plain = g;
  plain.epilogue = GemmEpilogue::none;
  plain.bias_grad = nullptr;
  gemm(plain, stream, workspace);
  if (g.epilogue == GemmEpilogue::bgrad_a)  // Σ_k A[i, k]: out index i (row stride), sum over k (col stride)
    strided_sum_launch(g.dtype, g.a.ptr, g.K, g.M, g.a.col_stride, g.a.row_stride, g.bias_grad, false, stream);
  else  // Σ_k B[k, j]
    strided_sum_launch(g.dtype, g.b.ptr, g.K, g.N, g.b.row_stride, g.b.col_stride, g.bias_grad, false, stream);
}

}  // namespace

bool gemm_operand_ok(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  return operand_layout(rows, cols, row_stride, col_stride).ok;
}

size_t gemm_plan_cache_size() { return plan_cache().size(); }

void gemm(const GemmArgs& g, cudaStream_t stream, void* workspace) {
  BLU_CHECK(g.M >= 0 && g.N >= 0 && g.K >= 0 && g.batch >= 1, "gemm: bad sizes M=", g.M, " N=", g.N, " K=", g.K,
            " batch=", g.batch);
  const bool bgrad = g.epilogue == GemmEpilogue::bgrad_a || g.epilogue == GemmEpilogue::bgrad_b;
  const bool uses_bias = g.epilogue == GemmEpilogue::bias || g.epilogue == GemmEpilogue::gelu_bias ||
                         g.epilogue == GemmEpilogue::gelu_aux_bias;
  BLU_CHECK(!uses_bias || g.bias, "gemm: epilogue ", gemm_epilogue_name(g.epilogue), " needs a bias");
  BLU_CHECK(!bgrad || (g.bias_grad && g.batch == 1), "gemm: epilogue ", gemm_epilogue_name(g.epilogue),
            " needs a bias_grad pointer and batch 1 (batch ", g.batch, ")");
  BLU_CHECK(g.epilogue != GemmEpilogue::gelu_aux_bias || (g.aux && g.aux_ld >= g.N && g.aux_ld % 8 == 0),
            "gemm: gelu_aux_bias needs aux with a row stride >= N and divisible by 8 (cuBLASLt), got aux_ld ",
            g.aux_ld, " for N ", g.N);
  BLU_CHECK(g.ldc >= std::max<int64_t>(g.N, 1), "gemm: ldc ", g.ldc, " < N ", g.N);
  BLU_CHECK(g.batch == 1 || g.c_batch_stride >= g.M * g.ldc, "gemm: output batch stride ", g.c_batch_stride,
            " overlaps matrices of ", g.M, " x ldc ", g.ldc);
  if (g.M == 0 || g.N == 0) {
    if (bgrad && g.K > 0 && (g.epilogue == GemmEpilogue::bgrad_a ? g.M : g.N) > 0)
      strided_sum_launch(g.dtype, g.epilogue == GemmEpilogue::bgrad_a ? g.a.ptr : g.b.ptr, g.K,
                         g.epilogue == GemmEpilogue::bgrad_a ? g.M : g.N,
                         g.epilogue == GemmEpilogue::bgrad_a ? g.a.col_stride : g.b.row_stride,
                         g.epilogue == GemmEpilogue::bgrad_a ? g.a.row_stride : g.b.col_stride, g.bias_grad, false,
                         stream);
    return;
  }
  if (g.K == 0) {  // an empty sum: D = beta·C (+ bias)
    BLU_CHECK(g.beta == 0 || (g.beta == 1 && g.c_in && g.batch == 1),
              "gemm: K == 0 with beta != 0 is supported only for beta = 1 with a separate C");
    BLU_CHECK(g.epilogue == GemmEpilogue::none || g.epilogue == GemmEpilogue::bias || bgrad, "gemm: K == 0 with the ",
              gemm_epilogue_name(g.epilogue), " epilogue is not supported");
    fill_rows_launch(g.c_f32 ? DType::f32 : g.dtype, g.c, g.batch, g.M, g.N, g.ldc, g.c_batch_stride,
                     g.epilogue == GemmEpilogue::bias ? g.bias : nullptr, g.beta != 0 ? g.c_in : nullptr, stream);
    if (bgrad) {
      const int64_t n = g.epilogue == GemmEpilogue::bgrad_a ? g.M : g.N;
      BLU_CUDA_CHECK(cudaMemsetAsync(g.bias_grad, 0, size_t(n) * dtype_size(g.dtype), stream));
    }
    return;
  }
  const OperandLayout lA = operand_layout(g.M, g.K, g.a.row_stride, g.a.col_stride);
  const OperandLayout lB = operand_layout(g.K, g.N, g.b.row_stride, g.b.col_stride);
  BLU_CHECK(lA.ok, "gemm: operand A [", g.M, ", ", g.K, "] with strides (", g.a.row_stride, ", ", g.a.col_stride,
            ") has no unit stride; pack it first");
  BLU_CHECK(lB.ok, "gemm: operand B [", g.K, ", ", g.N, "] with strides (", g.b.row_stride, ", ", g.b.col_stride,
            ") has no unit stride; pack it first");
  const bool f16ish = g.dtype == DType::bf16 || g.dtype == DType::f16;
  BLU_CHECK(!g.c_f32 || (f16ish && g.epilogue == GemmEpilogue::none), "gemm: an f32 C takes bf16/f16 operands and ",
            "no epilogue, got dtype ", g.dtype, " and epilogue ", gemm_epilogue_name(g.epilogue));
  BLU_CHECK((g.compute == GemmCompute::f16_f32) == f16ish &&
                (g.compute != GemmCompute::f64 || g.dtype == DType::f64) &&
                (g.compute == GemmCompute::f64 || g.compute == GemmCompute::f16_f32 || g.dtype == DType::f32),
            "gemm: compute mode ", int(g.compute), " does not fit dtype ", g.dtype);

  const void* bias_ptr = bgrad ? g.bias_grad : g.bias;
  const PlanKey key{current_device(), g.dtype, g.c_f32, g.compute, g.epilogue, lA.trans, lB.trans, g.beta != 0,
                    g.M, g.N, g.K, g.batch, lA.ld, lB.ld, g.ldc,
                    g.batch > 1 ? g.a.batch_stride : 0, g.batch > 1 ? g.b.batch_stride : 0,
                    g.batch > 1 ? g.c_batch_stride : 0, g.aux_ld,
                    alignment_of(g.a.ptr), alignment_of(g.b.ptr),
                    std::min(alignment_of(g.c), alignment_of(g.c_in)),
                    alignment_of(g.epilogue == GemmEpilogue::none ? nullptr : bias_ptr), alignment_of(g.aux)};
  PlanCache& cache = plan_cache();
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make_plan(key, g, lA, lB)).first;
  Plan& p = *it->second;
  if (!p.have_algo) {
    if (bgrad) return gemm_bgrad_fallback(g, stream, workspace);
    BLU_CHECK(false, "gemm: cuBLASLt found no algorithm for dtype ", g.dtype, " compute ", int(g.compute),
              " epilogue ", gemm_epilogue_name(g.epilogue), " M=", g.M, " N=", g.N, " K=", g.K, " batch=", g.batch,
              " lda=", lA.ld, (lA.trans ? " (A transposed)" : ""), " ldb=", lB.ld,
              (lB.trans ? " (B transposed)" : ""), " ldc=", g.ldc);
  }
  if (g.epilogue != GemmEpilogue::none) set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
  if (g.epilogue == GemmEpilogue::gelu_aux_bias)
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(g.aux));
  const double alpha_d = g.alpha, beta_d = g.beta;
  const void* alpha = g.compute == GemmCompute::f64 ? static_cast<const void*>(&alpha_d) : &g.alpha;
  const void* beta = g.compute == GemmCompute::f64 ? static_cast<const void*>(&beta_d) : &g.beta;
  if (!p.tuned) tune_plan(p, g, alpha, beta, stream, workspace);
  BLU_CUBLAS_CHECK(cublaslt().Matmul(cublaslt_handle(), p.desc, alpha, g.b.ptr, p.la, g.a.ptr, p.lb, beta,
                                  g.c_in ? g.c_in : g.c, p.lc, g.c, p.lc, &p.algo, workspace, kGemmWorkspaceBytes, stream));
}

}  // namespace blu::cuda
