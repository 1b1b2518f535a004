// CUDA kernels for ops/optim ("sum_squares" at the end). "adamw_step", "sgd_step": one pass over
// each parameter doing its whole update in place, with the CPU kernel's arithmetic
// (backend/cpu/optim.cpp) operation for operation: fp32 values, each product, sum, quotient and
// square root rounded once (__fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn, so nvcc cannot contract
// them into FMAs), the scalar coefficients computed on the host in double exactly as the CPU
// does, and a compute copy rounded as the cast kernels round (round16.cuh). So the GPU and the
// CPU agree bit for bit, step after step.
// AdamW runs many tensors per launch: a table of up to 64 contiguous tensors travels as the
// kernel parameter (under the 4 KiB limit), each tensor split into blocks of kAdamWChunk elements;
// a tensor whose operands are all 16-byte aligned (its compute copy 8-byte) moves float4 vectors,
// others go element by element. A tensor with a non-contiguous operand gets a strided launch of
// its own. A split master (Note [Split fp32], core/split_f32.h) is read from and written to its copy and
// low halves with the CPU's split_f32 / join_f32 (round16.cuh). bf16 moments (Note [Stochastic bf16
// moments], core/round_stochastic.h) are widened on load and stored with round16.cuh's bf16_bits_sr,
// the key computed on the host with the CPU's sr_key.
// Norm gate (Note [Norm gate], ops/optim.h): every thread reads the gate's total from device memory
// and decides in double, with correctly rounded operations as the CPU's std::sqrt and division
// are; a skipped update returns before touching anything, a clipped one multiplies each gradient
// element by float(coef) (__fmul_rn: the mul_scalar_ kernel's single fp32 product). No host read.
// Depends on backend/cuda/nn_common, round16. Keep: the operation order of the CPU kernel.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"
#include "blu/backend/cuda/round16.cuh"
#include "blu/core/round_stochastic.h"

namespace blu::cuda {

namespace {

bool all_contiguous(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && !t->is_contiguous()) return false;
  return true;
}

// --- the norm gate ---

struct GateRef {
  const void* total = nullptr;  // null: no gate
  bool f64 = false;             // the total's dtype: f64, else f32
  double max_norm = 0;
};
GateRef gate_ref(const KernelCall& c) {
  const int64_t index = c.attrs.i("gate");
  if (index < 0) return {};
  const Tensor& t = c.in[size_t(index)];
  return {t.raw_data(), t.dtype() == DType::f64, c.attrs.f("max_norm")};
}
struct GateDecision {
  bool skip, clip;
  float coef;
};
// The CPU kernel's read_gate (backend/cpu/optim.cpp), operation for operation.
__device__ __forceinline__ GateDecision read_gate(const GateRef& r) {
  if (!r.total) return {false, false, 1.0f};
  const double total = r.f64 ? *static_cast<const double*>(r.total) : double(*static_cast<const float*>(r.total));
  const double norm = __dsqrt_rn(total);
  if (!isfinite(norm)) return {true, false, 1.0f};
  const double coef = __ddiv_rn(r.max_norm, __dadd_rn(norm, 1e-6));
  return {false, coef < 1.0, __double2float_rn(coef)};
}
__device__ __forceinline__ float gated(float g, const GateDecision& d) { return d.clip ? __fmul_rn(g, d.coef) : g; }

// --- adamw_step ---

struct AdamWCoef {
  float decay, b1, b2, one_m_b1, one_m_b2, bc2_sqrt, eps, neg_step_size;
  uint32_t key_m, key_v;  // bf16 moments' rounding keys (Note [Stochastic bf16 moments])
};

// One element, in the CPU kernel's order.
__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v, const AdamWCoef& k) {
  p = __fmul_rn(p, k.decay);
  m = __fadd_rn(__fmul_rn(m, k.b1), __fmul_rn(k.one_m_b1, g));
  v = __fadd_rn(__fmul_rn(v, k.b2), __fmul_rn(__fmul_rn(k.one_m_b2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), k.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(k.neg_step_size, m), denom));
}

// The moments as held: fp32, or bf16 (SB) widened on load and rounded stochastically on store.
template <bool SB>
__device__ __forceinline__ float load_moment(const void* base, int64_t i) {
  if constexpr (SB) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(base)[i]) << 16);
  else return static_cast<const float*>(base)[i];
}
template <bool SB>
__device__ __forceinline__ void store_moment(void* base, int64_t i, float x, uint32_t key, float p) {
  if constexpr (SB) static_cast<uint16_t*>(base)[i] = bf16_bits_sr(x, sr_element_key(key, p));
  else static_cast<float*>(base)[i] = x;
}
template <bool SB>
__device__ __forceinline__ float4 load_moment4(const void* base, int64_t i) {
  if constexpr (SB) {
    const uint2 h = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    return make_float4(__uint_as_float(h.x << 16), __uint_as_float(h.x & 0xffff0000u), __uint_as_float(h.y << 16),
                       __uint_as_float(h.y & 0xffff0000u));
  } else {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
  }
}
template <bool SB>
__device__ __forceinline__ void store_moment4(void* base, int64_t i, const float4& x, uint32_t key, const float4& p) {
  if constexpr (SB) {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) =
        uint2{uint32_t(bf16_bits_sr(x.x, sr_element_key(key, p.x))) |
                  uint32_t(bf16_bits_sr(x.y, sr_element_key(key, p.y))) << 16,
              uint32_t(bf16_bits_sr(x.z, sr_element_key(key, p.z))) |
                  uint32_t(bf16_bits_sr(x.w, sr_element_key(key, p.w))) << 16};
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = x;
  }
}

// split: the master is held as its bf16 copy and its low halves (Note [Split fp32], core/split_f32.h);
// the table's p points at the low halves.
enum class CopyKind { none, bf16, f16, split };
template <CopyKind C>
__device__ __forceinline__ uint16_t round_copy(float p) {
  if constexpr (C == CopyKind::f16)
    return f16_bits_rn(p);
  else
    return bf16_bits_rn(p);
}

constexpr int kAdamWThreads = 256;
constexpr int kAdamWMaxTensors = 64;
constexpr int64_t kAdamWChunk = 4 * 4 * kAdamWThreads;  // elements per block: 4 float4 per thread

struct AdamWTable {
  float* p[kAdamWMaxTensors];  // CopyKind::split: the low halves (uint16_t)
  const float* g[kAdamWMaxTensors];
  void* m[kAdamWMaxTensors];  // f32, or bf16 bits (SB)
  void* v[kAdamWMaxTensors];
  uint16_t* c[kAdamWMaxTensors];  // compute copies (bf16/f16 bits); unused with CopyKind::none
  int64_t numel[kAdamWMaxTensors];
  int32_t first_block[kAdamWMaxTensors + 1];  // tensor i owns blocks [first_block[i], first_block[i+1])
  uint8_t vec[kAdamWMaxTensors];              // 1: every operand aligned for 4-element vectors
  int32_t count;
};
static_assert(sizeof(AdamWTable) + sizeof(AdamWCoef) + sizeof(GateRef) <= 4000,
              "kernel parameters are limited to 4 KiB");

template <CopyKind C, bool SB>
__global__ void __launch_bounds__(kAdamWThreads) adamw_multi_kernel(AdamWTable tab, AdamWCoef k, GateRef gate) {
  const GateDecision gd = read_gate(gate);
  if (gd.skip) return;
  const int b = blockIdx.x;
  const int t = owning_tensor(tab.first_block, tab.count, b);
  float* p = tab.p[t];
  const float* g = tab.g[t];
  void* m = tab.m[t];
  void* v = tab.v[t];
  uint16_t* c = tab.c[t];
  const int64_t begin = int64_t(b - tab.first_block[t]) * kAdamWChunk;
  const int64_t end = min(tab.numel[t], begin + kAdamWChunk);
  int64_t rest = begin;  // first element of the element-wise part
  auto* lo = reinterpret_cast<uint16_t*>(p);
  if (tab.vec[t]) {      // begin is a multiple of 4: aligned bases stay aligned
    const int64_t vec_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < vec_end; i += 4 * int64_t(blockDim.x)) {
      float4 p4;
      if constexpr (C == CopyKind::split) {
        const uint2 h = *reinterpret_cast<const uint2*>(c + i), l = *reinterpret_cast<const uint2*>(lo + i);
        p4 = make_float4(join_f32(uint16_t(h.x), uint16_t(l.x)), join_f32(uint16_t(h.x >> 16), uint16_t(l.x >> 16)),
                         join_f32(uint16_t(h.y), uint16_t(l.y)), join_f32(uint16_t(h.y >> 16), uint16_t(l.y >> 16)));
      } else {
        p4 = *reinterpret_cast<const float4*>(p + i);
      }
      float4 g4 = *reinterpret_cast<const float4*>(g + i);
      g4 = make_float4(gated(g4.x, gd), gated(g4.y, gd), gated(g4.z, gd), gated(g4.w, gd));
      float4 m4 = load_moment4<SB>(m, i);
      float4 v4 = load_moment4<SB>(v, i);
      adamw_update(p4.x, g4.x, m4.x, v4.x, k);
      adamw_update(p4.y, g4.y, m4.y, v4.y, k);
      adamw_update(p4.z, g4.z, m4.z, v4.z, k);
      adamw_update(p4.w, g4.w, m4.w, v4.w, k);
      store_moment4<SB>(m, i, m4, k.key_m, p4);
      store_moment4<SB>(v, i, v4, k.key_v, p4);
      if constexpr (C == CopyKind::split) {
        uint16_t h[4], l[4];
        split_f32(p4.x, h[0], l[0]);
        split_f32(p4.y, h[1], l[1]);
        split_f32(p4.z, h[2], l[2]);
        split_f32(p4.w, h[3], l[3]);
        *reinterpret_cast<uint2*>(c + i) = uint2{uint32_t(h[0]) | uint32_t(h[1]) << 16, uint32_t(h[2]) | uint32_t(h[3]) << 16};
        *reinterpret_cast<uint2*>(lo + i) = uint2{uint32_t(l[0]) | uint32_t(l[1]) << 16, uint32_t(l[2]) | uint32_t(l[3]) << 16};
      } else {
        *reinterpret_cast<float4*>(p + i) = p4;
      }
      if constexpr (C == CopyKind::bf16 || C == CopyKind::f16) {  // element i at the lower address: the low half (little endian)
        const uint2 c4{uint32_t(round_copy<C>(p4.x)) | uint32_t(round_copy<C>(p4.y)) << 16,
                       uint32_t(round_copy<C>(p4.z)) | uint32_t(round_copy<C>(p4.w)) << 16};
        *reinterpret_cast<uint2*>(c + i) = c4;
      }
    }
    rest = vec_end;
  }
  for (int64_t i = rest + threadIdx.x; i < end; i += blockDim.x) {
    float pi, mi = load_moment<SB>(m, i), vi = load_moment<SB>(v, i);
    if constexpr (C == CopyKind::split) pi = join_f32(c[i], lo[i]);
    else pi = p[i];
    adamw_update(pi, gated(g[i], gd), mi, vi, k);
    store_moment<SB>(m, i, mi, k.key_m, pi);
    store_moment<SB>(v, i, vi, k.key_v, pi);
    if constexpr (C == CopyKind::split) split_f32(pi, c[i], lo[i]);
    else p[i] = pi;
    if constexpr (C == CopyKind::bf16 || C == CopyKind::f16) c[i] = round_copy<C>(pi);
  }
}

// A tensor with a non-contiguous operand: offsets from each operand's StridedIndex.
template <CopyKind C, bool SB>
__global__ void adamw_strided_kernel(float* p, const float* g, void* m, void* v, uint16_t* c, int64_t n,
                                     StridedIndex ip, StridedIndex ig, StridedIndex im, StridedIndex iv,
                                     StridedIndex ic, AdamWCoef k, GateRef gate) {
  const GateDecision gd = read_gate(gate);
  if (gd.skip) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t om = im.offset(i), ov = iv.offset(i);
    float pi, mi = load_moment<SB>(m, om), vi = load_moment<SB>(v, ov);
    auto* lo = reinterpret_cast<uint16_t*>(p);  // split: the low halves and the copy are contiguous
    if constexpr (C == CopyKind::split) pi = join_f32(c[i], lo[i]);
    else pi = p[ip.offset(i)];
    adamw_update(pi, gated(g[ig.offset(i)], gd), mi, vi, k);
    store_moment<SB>(m, om, mi, k.key_m, pi);
    store_moment<SB>(v, ov, vi, k.key_v, pi);
    if constexpr (C == CopyKind::split) split_f32(pi, c[i], lo[i]);
    else p[ip.offset(i)] = pi;
    if constexpr (C == CopyKind::bf16 || C == CopyKind::f16) c[ic.offset(i)] = round_copy<C>(pi);
  }
}

const Tensor kNoTensor;
bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <CopyKind C, bool SB>
void adamw_launch(const KernelCall& call, const AdamWCoef& k) {
  const size_t stride = C == CopyKind::none ? 4 : 5;
  const GateRef gate = gate_ref(call);
  const size_t n_in = gate.total ? size_t(call.attrs.i("gate")) : call.in.size();  // the gate comes last
  cudaStream_t stream = stream_of(call.ctx);
  AdamWTable tab{};
  int32_t blocks = 0;
  auto flush = [&] {
    if (tab.count == 0) return;
    tab.first_block[tab.count] = blocks;
    adamw_multi_kernel<C, SB><<<unsigned(blocks), kAdamWThreads, 0, stream>>>(tab, k, gate);
    BLU_CUDA_CHECK_LAUNCH();
    tab = AdamWTable{};
    blocks = 0;
  };
  for (size_t i = 0; i < n_in; i += stride) {
    const Tensor &p = call.in[i], &g = call.in[i + 1], &m = call.in[i + 2], &v = call.in[i + 3];
    const Tensor& c = C == CopyKind::none ? kNoTensor : call.in[i + 4];
    const int64_t n = g.numel();  // p: split masters' low halves are u8, two bytes an element
    if (n == 0) continue;
    auto* pp = static_cast<float*>(p.raw_data());
    auto* gp = static_cast<const float*>(g.raw_data());
    void* mp = m.raw_data();
    void* vp = v.raw_data();
    auto* cp = c.defined() ? static_cast<uint16_t*>(c.raw_data()) : nullptr;
    if (!all_contiguous({&p, &g, &m, &v, &c})) {
      adamw_strided_kernel<C, SB><<<grid_for(n), 256, 0, stream>>>(
          pp, gp, mp, vp, cp, n, C == CopyKind::split ? StridedIndex{} : strided_index(p), strided_index(g),
          strided_index(m), strided_index(v), c.defined() ? strided_index(c) : StridedIndex{}, k, gate);
      BLU_CUDA_CHECK_LAUNCH();
      continue;
    }
    const int64_t nb = (n + kAdamWChunk - 1) / kAdamWChunk;
    if (tab.count == kAdamWMaxTensors || int64_t(blocks) + nb > INT32_MAX) flush();
    BLU_CHECK(nb <= INT32_MAX, "adamw_step: a tensor of ", n, " elements is too large for one launch");
    const int j = tab.count++;
    tab.p[j] = pp;
    tab.g[j] = gp;
    tab.m[j] = mp;
    tab.v[j] = vp;
    tab.c[j] = cp;
    tab.numel[j] = n;
    tab.first_block[j] = blocks;
    const uintptr_t mv = SB ? 8 : 16;  // four moments
    tab.vec[j] = aligned(pp, C == CopyKind::split ? 8 : 16) && aligned(gp, 16) && aligned(mp, mv) && aligned(vp, mv) &&
                 (!cp || aligned(cp, 8));
    blocks += int32_t(nb);
  }
  flush();
}

template <bool SB>
void adamw_dispatch(const KernelCall& c, const AdamWCoef& k) {
  const Attrs& a = c.attrs;
  if (!a.b("copies"))
    adamw_launch<CopyKind::none, SB>(c, k);
  else if (a.has("split") && a.b("split"))
    adamw_launch<CopyKind::split, SB>(c, k);
  else if (c.in[4].dtype() == DType::f16)
    adamw_launch<CopyKind::f16, SB>(c, k);
  else
    adamw_launch<CopyKind::bf16, SB>(c, k);
}

void adamw_step_kernel(const KernelCall& c) {
  const Attrs& a = c.attrs;
  const double lr = a.f("lr"), b1 = a.f("beta1"), b2 = a.f("beta2"), wd = a.f("weight_decay");
  const double t = double(a.i("step"));
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  const AdamWCoef k{float(1 - lr * wd), float(b1), float(b2), float(1 - b1), float(1 - b2), float(std::sqrt(bc2)),
                    float(a.f("eps")), float(-(lr / bc1)), sr_key(a.i("step"), 0), sr_key(a.i("step"), 1)};
  if (c.in[2].dtype() == DType::bf16)  // one op's moments share a dtype (ops/optim.cpp)
    adamw_dispatch<true>(c, k);
  else
    adamw_dispatch<false>(c, k);
}
BLU_REGISTER_KERNEL(cuda, "adamw_step", adamw_step_kernel);

// --- sgd_step ---

struct SGDCoef {
  float neg_lr, mom, wd;
  bool use_wd, use_buf, nesterov, init;
};

__global__ void sgd_kernel(float* p, const float* g, float* buf, int64_t n, bool contiguous, StridedIndex ip,
                           StridedIndex ig, StridedIndex ib, SGDCoef k, GateRef gate) {
  const GateDecision gd = read_gate(gate);
  if (gd.skip) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t op = contiguous ? i : ip.offset(i), og = contiguous ? i : ig.offset(i);
    float d = gated(g[og], gd);
    if (k.use_wd) d = __fadd_rn(d, __fmul_rn(k.wd, p[op]));
    if (k.use_buf) {
      const int64_t ob = contiguous ? i : ib.offset(i);
      const float b = k.init ? d : __fadd_rn(__fmul_rn(buf[ob], k.mom), d);
      buf[ob] = b;
      d = k.nesterov ? __fadd_rn(d, __fmul_rn(k.mom, b)) : b;
    }
    p[op] = __fadd_rn(p[op], __fmul_rn(k.neg_lr, d));
  }
}

void sgd_step_kernel(const KernelCall& c) {
  const Tensor& p = c.out[0];
  const Tensor& g = c.in[1];
  const Tensor& buf = c.in[2];
  const int64_t n = p.numel();
  if (n == 0) return;
  const Attrs& a = c.attrs;
  const SGDCoef k{float(-a.f("lr")), float(a.f("momentum")), float(a.f("weight_decay")), a.f("weight_decay") != 0,
                  buf.defined(), a.b("nesterov"), a.b("init_buffer")};
  sgd_kernel<<<grid_for(n), 256, 0, stream_of(c.ctx)>>>(
      static_cast<float*>(p.raw_data()), static_cast<const float*>(g.raw_data()),
      buf.defined() ? static_cast<float*>(buf.raw_data()) : nullptr, n, all_contiguous({&p, &g, &buf}),
      strided_index(p), strided_index(g), buf.defined() ? strided_index(buf) : StridedIndex{}, k, gate_ref(c));
  BLU_CUDA_CHECK_LAUNCH();
}
BLU_REGISTER_KERNEL(cuda, "sgd_step", sgd_step_kernel);

// --- sum_squares: Σ x² over many tensors in two launches ---
// Launch 1 (one per kMaxTensors tensors): each tensor gets a fixed number of blocks, set by its
// size alone; block b of tensor t sums the squares of its grid-stride share in fp32 and writes
// one partial. The table of (pointer, numel, dtype, first block) travels as the kernel parameter
// (under the 4 KiB parameter limit). Launch 2: one block sums all the partials in a fixed order
// (double, rounded to f32 once). No atomics: the result depends only on the shapes, so reruns
// are bit-identical.
constexpr int kSqThreads = 256;
constexpr int kMaxTensors = 160;
constexpr int64_t kSqElemsPerBlock = 16384;  // a block covers at least this many elements
constexpr int64_t kSqMaxBlocksPerTensor = 256;

struct SumSquaresTable {
  const void* ptr[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t first_block[kMaxTensors + 1];  // tensor i owns blocks [first_block[i], first_block[i+1])
  uint8_t dtype[kMaxTensors];            // DType value
  int32_t count;
};
static_assert(sizeof(SumSquaresTable) <= 4000, "kernel parameters are limited to 4 KiB");

template <typename T>
__device__ __forceinline__ float sq_sum_range(const T* p, int64_t n, int64_t start, int64_t step) {
  float s = 0;
  for (int64_t i = start; i < n; i += step) {
    const float v = float(to_acc(p[i]));
    s = fmaf(v, v, s);
  }
  return s;
}

__global__ void sum_squares_partial_kernel(SumSquaresTable tab, float* partials) {
  __shared__ float shared[32];
  const int b = blockIdx.x;
  const int t = owning_tensor(tab.first_block, tab.count, b);
  const int64_t nblocks = tab.first_block[t + 1] - tab.first_block[t];
  const int64_t start = int64_t(b - tab.first_block[t]) * kSqThreads + threadIdx.x, step = nblocks * kSqThreads;
  float s = 0;
  switch (DType(tab.dtype[t])) {  // uniform over the block
    case DType::f32: s = sq_sum_range(static_cast<const float*>(tab.ptr[t]), tab.numel[t], start, step); break;
    case DType::f64: s = sq_sum_range(static_cast<const double*>(tab.ptr[t]), tab.numel[t], start, step); break;
    case DType::bf16: s = sq_sum_range(static_cast<const __nv_bfloat16*>(tab.ptr[t]), tab.numel[t], start, step); break;
    case DType::f16: s = sq_sum_range(static_cast<const __half*>(tab.ptr[t]), tab.numel[t], start, step); break;
    default: break;
  }
  s = block_sum(s, shared);
  if (threadIdx.x == 0) partials[b] = s;
}

__global__ void sum_squares_final_kernel(const float* partials, int64_t n, float* out) {
  __shared__ double shared[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += double(partials[i]);
  s = block_sum(s, shared);
  if (threadIdx.x == 0) *out = float(s);
}

void sum_squares_kernel(const KernelCall& c) {
  float* out = static_cast<float*>(c.out[0].raw_data());
  std::vector<const Tensor*> ts;
  std::vector<int64_t> blocks;
  int64_t total = 0;
  for (const Tensor& t : c.in) {
    if (t.numel() == 0) continue;
    BLU_ASSERT(t.is_contiguous(), "sum_squares: ", t.str(), " is not contiguous (ops/optim copies first)");
    const int64_t nb = std::min(kSqMaxBlocksPerTensor, (t.numel() + kSqElemsPerBlock - 1) / kSqElemsPerBlock);
    ts.push_back(&t);
    blocks.push_back(nb);
    total += nb;
  }
  cudaStream_t stream = stream_of(c.ctx);
  if (ts.empty()) {
    BLU_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), stream));
    return;
  }
  Scratch partials(c.ctx, size_t(total) * sizeof(float));
  int64_t done = 0;  // blocks launched so far = offset of this launch's partials
  for (size_t first = 0; first < ts.size(); first += kMaxTensors) {
    SumSquaresTable tab{};
    tab.count = int32_t(std::min<size_t>(kMaxTensors, ts.size() - first));
    int32_t nb = 0;
    for (int i = 0; i < tab.count; ++i) {
      const Tensor& t = *ts[first + size_t(i)];
      tab.ptr[i] = t.raw_data();
      tab.numel[i] = t.numel();
      tab.dtype[i] = uint8_t(t.dtype());
      tab.first_block[i] = nb;
      nb += int32_t(blocks[first + size_t(i)]);
    }
    tab.first_block[tab.count] = nb;
    sum_squares_partial_kernel<<<unsigned(nb), kSqThreads, 0, stream>>>(tab, partials.as<float>() + done);
    BLU_CUDA_CHECK_LAUNCH();
    done += nb;
  }
  sum_squares_final_kernel<<<1, 1024, 0, stream>>>(partials.as<float>(), total, out);
  BLU_CUDA_CHECK_LAUNCH();
}
BLU_REGISTER_KERNEL(cuda, "sum_squares", sum_squares_kernel);

}  // namespace

}  // namespace blu::cuda
