// CUDA kernels for ops/linalg ("matmul", "linear", "linear_weight_grad[_into]"; "linear_gelu" for
// the compiler's GELU epilogue) over the cuBLASLt gemm of gemm.h, and the small helper kernels
// gemm needs (fill rows with a bias, pack a strided operand, a deterministic strided sum for the
// bias-gradient fallback).
// Operands reach cuBLAS uncopied whenever one of their two matrix strides is 1 (transposed views
// included); others (stride 0 from expand inside a matrix, every-other-element views) are packed
// into a temporary from the caching allocator. Batch dims that are laid out as one are merged
// into a single strided-batched call; the rest loop on the host (no synchronisation).
#include <algorithm>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/backend/cuda/gemm.h"
#include "blu/backend/cuda/nn_common.cuh"

namespace blu::cuda {

// --- helper kernels -------------------------------------------------------------------------

namespace {

template <typename T>
__global__ void fill_rows_kernel(T* dst, int64_t batch, int64_t rows, int64_t cols, int64_t ldc, int64_t bs,
                                 const T* bias, const T* add) {
  const int64_t total = batch * rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % cols, r = (i / cols) % rows, b = i / (cols * rows);
    const int64_t at = b * bs + r * ldc + c;
    dst[at] = from_acc<T>((bias ? to_acc(bias[c]) : acc_of<T>(0)) + (add ? to_acc(add[at]) : acc_of<T>(0)));
  }
}

template <typename U>
__global__ void pack_strided_kernel(const U* src, U* dst, int64_t n, StridedIndex idx) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[idx.offset(i)];
}

// O: T, or float (the fp32 sum unrounded).
template <typename T, typename O>
__global__ void strided_sum_kernel(const T* src, int64_t n_sum, int64_t n_out, int64_t ss, int64_t os, O* dst) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n_out; j += int64_t(gridDim.x) * blockDim.x) {
    acc_of<T> s = 0;
    for (int64_t i = 0; i < n_sum; ++i) s += to_acc(src[i * ss + j * os]);
    dst[j] = from_acc<O>(acc_of<O>(s));
  }
}

// out[N] = Σ_r g[r, :] through the kernels above when g suits them (contiguous, aligned,
// N % V == 0, 16-bit or f32); false otherwise (nothing launched). out is in g's dtype or f32.
bool column_sum_fast(const Tensor& g, const Tensor& out, cudaStream_t s, Workspace& ws) {
  const DType dt = g.dtype();
  if (g.dim() != 2 || !g.is_contiguous() || reinterpret_cast<uintptr_t>(g.raw_data()) % 16 != 0 ||
      !(dt == DType::f32 || dt == DType::bf16 || dt == DType::f16))
    return false;
  const int64_t R = g.shape()[0], N = g.shape()[1];
  bool done = false;
  BLU_CUDA_DISPATCH_FLOATING(dt, "column_sum", {
    if constexpr (sizeof(scalar_t) <= 4) {
      if (colsum_fits<scalar_t>(R, N)) {
        colsum_launch<scalar_t>(R, N, ColsumLoad<scalar_t>{static_cast<const scalar_t*>(g.raw_data())}, out.raw_data(),
                                out.dtype() == DType::f32, s, ws);
        done = true;
      }
    }
  });
  return done;
}

}  // namespace

void fill_rows_launch(DType dtype, void* dst, int64_t batch, int64_t rows, int64_t cols, int64_t ldc, int64_t bs,
                      const void* bias, const void* add, cudaStream_t stream) {
  const int64_t total = batch * rows * cols;
  if (total == 0) return;
  BLU_CUDA_DISPATCH_FLOATING(dtype, "fill_rows", {
    fill_rows_kernel<scalar_t><<<grid_for(total), 256, 0, stream>>>(
        static_cast<scalar_t*>(dst), batch, rows, cols, ldc, bs, static_cast<const scalar_t*>(bias),
        static_cast<const scalar_t*>(add));
    BLU_CUDA_CHECK_LAUNCH();
  });
}

void pack_strided_launch(size_t elem_size, const void* src, void* dst, int rank, const int64_t* shape,
                         const int64_t* strides, cudaStream_t s) {
  BLU_CHECK(rank <= StridedIndex::kMaxRank, "pack: rank ", rank, " > ", StridedIndex::kMaxRank);
  StridedIndex idx;
  idx.rank = rank;
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) {
    idx.shape[d] = shape[d];
    idx.strides[d] = strides[d];
    n *= shape[d];
  }
  if (n == 0) return;
  const unsigned grid = grid_for(n);
  switch (elem_size) {
    case 2: pack_strided_kernel<<<grid, 256, 0, s>>>(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), n, idx); break;
    case 4: pack_strided_kernel<<<grid, 256, 0, s>>>(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), n, idx); break;
    case 8: pack_strided_kernel<<<grid, 256, 0, s>>>(static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), n, idx); break;
    default: BLU_ASSERT(false, "pack: element size ", elem_size);
  }
  BLU_CUDA_CHECK_LAUNCH();
}

void strided_sum_launch(DType dtype, const void* src, int64_t n_sum, int64_t n_out, int64_t sum_stride,
                        int64_t out_stride, void* dst, bool out_f32, cudaStream_t stream) {
  if (n_out == 0) return;
  BLU_CUDA_DISPATCH_FLOATING(dtype, "strided_sum", {
    if (out_f32)
      strided_sum_kernel<scalar_t, float><<<grid_for(n_out), 256, 0, stream>>>(
          static_cast<const scalar_t*>(src), n_sum, n_out, sum_stride, out_stride, static_cast<float*>(dst));
    else
      strided_sum_kernel<scalar_t, scalar_t><<<grid_for(n_out), 256, 0, stream>>>(
          static_cast<const scalar_t*>(src), n_sum, n_out, sum_stride, out_stride, static_cast<scalar_t*>(dst));
    BLU_CUDA_CHECK_LAUNCH();
  });
}

StridedIndex strided_index(const Tensor& t) {
  BLU_CHECK(t.dim() <= StridedIndex::kMaxRank, "CUDA kernels take tensors of rank <= ", StridedIndex::kMaxRank,
            ", got ", t.shape());
  StridedIndex idx;
  idx.rank = int(t.dim());
  for (int d = 0; d < idx.rank; ++d) {
    idx.shape[d] = t.shape()[size_t(d)];
    idx.strides[d] = t.strides()[size_t(d)];
  }
  return idx;
}

// --- op kernels -------------------------------------------------------------------------------

namespace {

// An operand as the kernels see it: the data pointer and strides, after packing (into the call's
// workspace) when needed.
struct Operand {
  const void* ptr;
  Shape strides;
};

Operand prepare(const Tensor& t, cudaStream_t s, Workspace& ws) {
  const int64_t n = t.dim();
  if (gemm_operand_ok(t.shape()[n - 2], t.shape()[n - 1], t.strides()[n - 2], t.strides()[n - 1]))
    return {t.raw_data(), t.strides()};
  void* packed = ws.take(std::max<size_t>(t.nbytes(), 1));
  pack_strided_launch(t.itemsize(), t.raw_data(), packed, int(n), t.shape().data(), t.strides().data(), s);
  return {packed, contiguous_strides(t.shape())};
}

// out[..., M, N] = a[..., M, K] · b[..., K, N], equal batch dims, any strides.
void matmul_kernel(const KernelCall& c) {
  const Tensor &a = c.in[0], &b = c.in[1];
  Tensor& out = c.out[0];
  const int64_t nd = a.dim(), nb = nd - 2;
  const int64_t M = a.shape()[nb], K = a.shape()[nb + 1], N = b.shape()[nb + 1];
  if (out.numel() == 0) return;
  const cudaStream_t s = stream_of(c.ctx);
  Workspace& ws = *c.ctx.scratch;
  void* gemm_ws = ws.take(kGemmWorkspaceBytes);
  const Operand pa = prepare(a, s, ws), pb = prepare(b, s, ws);
  const Shape os = out.strides();
  // Batch dims, size-1 ones dropped, merged where all three operands lay them out as one.
  struct BDim { int64_t size, sa, sb, so; };
  std::vector<BDim> dims;
  for (int64_t d = 0; d < nb; ++d) {
    const int64_t sz = out.shape()[d];
    if (sz == 1) continue;
    const BDim cur{sz, pa.strides[d], pb.strides[d], os[d]};
    if (!dims.empty()) {
      BDim& prev = dims.back();
      if (prev.sa == cur.sa * cur.size && prev.sb == cur.sb * cur.size && prev.so == cur.so * cur.size) {
        prev = {prev.size * cur.size, cur.sa, cur.sb, cur.so};
        continue;
      }
    }
    dims.push_back(cur);
  }
  GemmArgs g;
  g.dtype = a.dtype();
  g.compute = default_gemm_compute(a.dtype());
  g.M = M;
  g.N = N;
  g.K = K;
  g.ldc = N;
  g.a = {nullptr, pa.strides[nb], pa.strides[nb + 1], 0};
  g.b = {nullptr, pb.strides[nb], pb.strides[nb + 1], 0};
  BDim inner{1, 0, 0, M * N};
  if (!dims.empty()) {
    inner = dims.back();
    dims.pop_back();
  }
  g.batch = inner.size;
  g.a.batch_stride = inner.sa;
  g.b.batch_stride = inner.sb;
  g.c_batch_stride = inner.so;
  int64_t outer = 1;
  for (const BDim& d : dims) outer *= d.size;
  const size_t es = a.itemsize();
  for (int64_t o = 0; o < outer; ++o) {
    int64_t oa = 0, ob = 0, oo = 0, rem = o;
    for (int64_t d = int64_t(dims.size()) - 1; d >= 0; --d) {
      const int64_t i = rem % dims[size_t(d)].size;
      rem /= dims[size_t(d)].size;
      oa += i * dims[size_t(d)].sa;
      ob += i * dims[size_t(d)].sb;
      oo += i * dims[size_t(d)].so;
    }
    g.a.ptr = static_cast<const char*>(pa.ptr) + oa * int64_t(es);
    g.b.ptr = static_cast<const char*>(pb.ptr) + ob * int64_t(es);
    g.c = static_cast<char*>(out.raw_data()) + oo * int64_t(es);
    gemm(g, s, gemm_ws);
  }
}
BLU_REGISTER_KERNEL(cuda, "matmul", matmul_kernel);

// The product both linear kernels run, out[R, out] = x[R, in] · w[out, in]ᵀ: x and w prepared on
// the call's stream, the GEMM's workspace taken from the call's.
struct LinearGemm {
  GemmArgs args;
  cudaStream_t stream;
  void* workspace;
};
LinearGemm linear_gemm(const KernelCall& c, const Tensor& out) {
  const Tensor &x = c.in[0], &w = c.in[1];
  const cudaStream_t s = stream_of(c.ctx);
  Workspace& ws = *c.ctx.scratch;
  void* gemm_ws = ws.take(kGemmWorkspaceBytes);
  const Operand px = prepare(x, s, ws), pw = prepare(w, s, ws);
  GemmArgs g;
  g.dtype = x.dtype();
  g.compute = default_gemm_compute(x.dtype());
  g.M = x.shape()[0];
  g.K = x.shape()[1];
  g.N = w.shape()[0];
  g.a = {px.ptr, px.strides[0], px.strides[1], 0};
  g.b = {pw.ptr, pw.strides[1], pw.strides[0], 0};  // B[k, n] = w[n, k]
  g.c = out.raw_data();
  g.ldc = g.N;
  return {g, s, gemm_ws};
}

// out[R, out] = x[R, in] · w[out, in]ᵀ + bias (+ residual), the bias fused as a cuBLASLt epilogue
// and the residual read as C with beta = 1 (f64: the rows are filled with bias + residual first and
// the product accumulated onto them).
void linear_kernel(const KernelCall& c) {
  const Tensor &x = c.in[0], &bias = c.in[2], &residual = c.in[3];
  Tensor& out = c.out[0];
  if (out.numel() == 0) return;
  auto [g, s, gemm_ws] = linear_gemm(c, out);
  const void* bp = nullptr;
  if (bias.defined()) {
    bp = bias.raw_data();
    if (bias.shape()[0] > 1 && bias.strides()[0] != 1) {
      void* packed = c.ctx.scratch->take(bias.nbytes());
      pack_strided_launch(bias.itemsize(), bias.raw_data(), packed, 1, bias.shape().data(), bias.strides().data(), s);
      bp = packed;
    }
  }
  const void* rp = residual.defined() ? residual.raw_data() : nullptr;
  if ((bp || rp) && x.dtype() == DType::f64) {
    fill_rows_launch(g.dtype, g.c, 1, g.M, g.N, g.ldc, 0, bp, rp, s);
    if (g.K == 0) return;
    g.beta = 1;
  } else {
    if (bp) {
      g.epilogue = GemmEpilogue::bias;
      g.bias = bp;
    }
    if (rp) {
      g.c_in = rp;
      g.beta = 1;
    }
  }
  gemm(g, s, gemm_ws);
}
BLU_REGISTER_KERNEL(cuda, "linear", linear_kernel);

// The compiler's GELU epilogue (compiler/epilogue.h): out[0] = gelu_tanh(x·wᵀ + bias) and out[1] =
// x·wᵀ + bias, both [R, out], in one GEMM (cuBLASLt's GELU_AUX_BIAS; 16-bit, out % 8 == 0).
void linear_gelu_kernel(const KernelCall& c) {
  const Tensor &x = c.in[0], &w = c.in[1], &bias = c.in[2];
  Tensor &out = c.out[0], &pre = c.out[1];
  BLU_CHECK((x.dtype() == DType::bf16 || x.dtype() == DType::f16) && bias.defined() && bias.is_contiguous() &&
                out.is_contiguous() && pre.is_contiguous() && w.shape()[0] % 8 == 0,
            "linear_gelu: needs 16-bit operands, a contiguous bias and outputs, and a multiple of 8 output "
            "features; got x ", x.str(), ", w ", w.str(), ", bias ", bias.str());
  if (out.numel() == 0) return;
  auto [g, s, gemm_ws] = linear_gemm(c, out);
  g.epilogue = GemmEpilogue::gelu_aux_bias;
  g.bias = bias.raw_data();
  g.aux = pre.raw_data();
  g.aux_ld = g.N;
  gemm(g, s, gemm_ws);
}
BLU_REGISTER_KERNEL(cuda, "linear_gelu", linear_gelu_kernel);

// grad_w[out, in] = g[R, out]ᵀ · x[R, in] and grad_b[o] = Σ_r g[r, o]. Where g suits the column-
// sum kernels above, a plain GEMM and that sum: cuBLASLt's BGRAD epilogue picks slower kernels
// (GPT-2 124M on an H200: 434 TFLOP/s with it in bf16 vs ~600 for the plain GEMMs of the same
// step; 156 vs ~300 in tf32). Otherwise the bias gradient is the row sum of A = gᵀ through the
// BGRAD epilogue (gemm falls back to a plain gemm and a deterministic sum kernel where cuBLASLt
// has no algorithm for it, e.g. f64). gw and gb (optional) are each in g's dtype or, for a 16-bit
// g, in f32 (linear_weight_grad_into): then the GEMM stores its fp32 sums and the bias gradient
// comes from the sum kernels.
void weight_grads(const Tensor& g, const Tensor& x, const Tensor& gw, const Tensor* gb, const ExecContext& ctx,
                  bool accumulate = false) {
  const cudaStream_t s = stream_of(ctx);
  Workspace& ws = *ctx.scratch;
  void* gemm_ws = ws.take(kGemmWorkspaceBytes);
  const Operand pg = prepare(g, s, ws), px = prepare(x, s, ws);
  GemmArgs a;
  a.dtype = g.dtype();
  a.compute = default_gemm_compute(g.dtype());
  a.M = g.shape()[1];
  a.K = g.shape()[0];
  a.N = x.shape()[1];
  a.a = {pg.ptr, pg.strides[1], pg.strides[0], 0};  // A[m, k] = g[k, m]
  a.b = {px.ptr, px.strides[0], px.strides[1], 0};
  a.c = gw.raw_data();
  a.ldc = std::max<int64_t>(a.N, 1);
  a.c_f32 = gw.dtype() != g.dtype();
  if (accumulate) {  // gw += gᵀ·x (no bias gradient: the op's check)
    if (a.K == 0) return;
    a.beta = 1;
  }
  if (!gb || gb->numel() == 0) return gemm(a, s, gemm_ws);
  const bool gb_f32 = gb->dtype() != g.dtype();
  if (a.K > 0 && a.N > 0 && column_sum_fast(g, *gb, s, ws)) return gemm(a, s, gemm_ws);
  if (a.c_f32 || gb_f32) {  // the epilogue writes C's dtype: a separate deterministic sum instead
    gemm(a, s, gemm_ws);
    return strided_sum_launch(g.dtype(), pg.ptr, a.K, a.M, pg.strides[0], pg.strides[1], gb->raw_data(), gb_f32, s);
  }
  a.epilogue = GemmEpilogue::bgrad_a;
  a.bias_grad = gb->raw_data();
  if (a.K == 0 && a.N == 0) {  // gemm returns at once on an empty C: the bias gradient is Σ of nothing
    BLU_CUDA_CHECK(cudaMemsetAsync(gb->raw_data(), 0, gb->nbytes(), s));
    return;
  }
  gemm(a, s, gemm_ws);
}
void linear_weight_grad_kernel(const KernelCall& c) {
  if (c.out[1].numel() == 0) return;  // out == 0: both outputs empty
  weight_grads(c.in[0], c.in[1], c.out[0], &c.out[1], c.ctx);
}
// In place: (gw, g, x[, gb]).
void linear_weight_grad_into_kernel(const KernelCall& c) {
  if (c.in[0].numel() == 0 && !(c.in[3].defined() && c.in[3].numel() > 0)) return;
  weight_grads(c.in[1], c.in[2], c.in[0], c.in[3].defined() ? &c.in[3] : nullptr, c.ctx, c.attrs.has("accumulate"));
}
BLU_REGISTER_KERNEL(cuda, "linear_weight_grad_into", linear_weight_grad_into_kernel);
BLU_REGISTER_KERNEL(cuda, "linear_weight_grad", linear_weight_grad_kernel);

}  // namespace

}  // namespace blu::cuda
