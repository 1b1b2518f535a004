// CUDA kernels for ops/norm_rotary, part 2, and ops/swiglu: rotary_embedding (+ backward), silu
// (+ backward), swiglu (+ backward), with the CPU kernels' semantics (backend/cpu/norm_rotary.cpp,
// backend/cpu/swiglu.cpp). All are elementwise and memory-bound:
// - rotary: a thread takes V elements (16 bytes) of the first half of a row at column j and the V
//   elements at j + D/2 — the pairs the rotation mixes — from x of any strides over (B, T, H)
//   with unit stride along D, and the matching cos/sin vectors of row t (f32 or x's dtype; [T, D]
//   is small and stays in L2), and writes both to the contiguous output (unrotated for heads past
//   the op's "rotate"), or back where they were (rotary_backward_heads_in_place: x is y, heads
//   outside the range untouched). Index → (b, t, h, j) by 32-bit magic-number division. The scalar
//   form (V = 1) takes rows whose half or strides are not whole vectors, or misaligned data.
// - silu, silu_backward and swiglu through loops.cuh's launch_map (its 16-byte paths, row-strided
//   views included: the halves of one [N, 2I] projection are read where they lie).
// - swiglu_backward: one pass over rows of whole 16-byte vectors (or scalars) reading g, gate, up
//   with their row strides and writing d_gate, d_up with theirs — into one [N, 2I] buffer side by
//   side when the op asks (Note [SwiGLU gradients side by side], ops/swiglu.cpp).
// 16-bit types compute in float and round once; the formulas keep the CPU's association, without
// FMA contraction (the *_rn helpers), so results differ from the CPU's only through expf.
#include "blu/backend/cuda/loops.cuh"
#include "blu/backend/cuda/rotary.cuh"

namespace blu::cuda {

namespace {

__device__ __forceinline__ float exp_acc(float x) { return ::expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return ::exp(x); }

template <typename A>
__device__ __forceinline__ A sigmoid_acc(A x) {
  return A(1) / add_rn(A(1), exp_acc(-x));
}
// silu'(x) = s·(1 + x·(1 − s)).
template <typename A>
__device__ __forceinline__ A silu_grad_acc(A x, A s) {
  return mul_rn(s, add_rn(A(1), mul_rn(x, sub_rn(A(1), s))));
}

// 32-bit magic division when the index space fits, else 64-bit.
struct IndexDiv {
  Div32 d32;
  int64_t d = 1;
  bool wide = false;
  IndexDiv() = default;
  IndexDiv(int64_t divisor, bool w) : d(divisor), wide(w) {
    if (!w) d32 = Div32(uint32_t(divisor));
  }
  __device__ __forceinline__ int64_t div(int64_t n) const { return wide ? n / d : int64_t(d32.div(uint32_t(n))); }
};

// --- rotary_embedding --------------------------------------------------------------------------

struct RotaryShape {
  int64_t n = 0;                   // work items: B·T·H rows × h / V vectors
  int64_t T = 0, H = 0, D = 0;     // D = 2h
  int64_t first = 0, last = 0;     // heads [first, last) are rotated, the others copied
  int64_t sb = 0, st = 0, sh = 0;  // x's strides over (B, T, H), in elements
  IndexDiv per_row, heads, times;  // by h / V, H, T
};

// rope_pair (rotary.cuh) on each pair; y is contiguous. x and y may be the same buffer (each thread
// reads its 2·V elements before it writes them, and leaves the heads it would only copy), so
// neither is __restrict__.
template <typename T, typename CS, int V, bool kBackward>
__global__ void rotary_kernel(const T* x, const CS* __restrict__ cos, const CS* __restrict__ sin, T* y,
                              RotaryShape s) {
  using A = acc_t<T>;
  const int64_t h = s.D / 2;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < s.n; i += step) {
    const int64_t row = s.per_row.div(i), j = (i - row * (h / V)) * V;
    const int64_t bt = s.heads.div(row), hh = row - bt * s.H;
    const int64_t b = s.times.div(bt), t = bt - b * s.T;
    const bool rotate = hh >= s.first && hh < s.last;  // no cos/sin read for the others
    if (!rotate && x == y) continue;
    const T* xr = x + b * s.sb + t * s.st + hh * s.sh;
    const Vec<T, V> x1 = *reinterpret_cast<const Vec<T, V>*>(xr + j);
    const Vec<T, V> x2 = *reinterpret_cast<const Vec<T, V>*>(xr + j + h);
    Vec<T, V> y1 = x1, y2 = x2;
    if (rotate) {
      const Vec<CS, V> c1 = *reinterpret_cast<const Vec<CS, V>*>(cos + t * s.D + j);
      const Vec<CS, V> c2 = *reinterpret_cast<const Vec<CS, V>*>(cos + t * s.D + j + h);
      const Vec<CS, V> s1 = *reinterpret_cast<const Vec<CS, V>*>(sin + t * s.D + j);
      const Vec<CS, V> s2 = *reinterpret_cast<const Vec<CS, V>*>(sin + t * s.D + j + h);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        A r1, r2;
        rope_pair<kBackward>(A(to_acc(x1.v[e])), A(to_acc(x2.v[e])), A(to_acc(c1.v[e])), A(to_acc(s1.v[e])),
                             A(to_acc(c2.v[e])), A(to_acc(s2.v[e])), r1, r2);
        y1.v[e] = from_acc<T>(r1);
        y2.v[e] = from_acc<T>(r2);
      }
    }
    T* yr = y + row * s.D;
    *reinterpret_cast<Vec<T, V>*>(yr + j) = y1;
    *reinterpret_cast<Vec<T, V>*>(yr + j + h) = y2;
  }
}

// x: [B, T, H, D] with unit stride along D; y: contiguous [B, T, H, D], or x itself (then
// contiguous, and the heads outside [first, last) are left as they are).
template <typename T, typename CS, bool kBackward>
void launch_rotary(cudaStream_t stream, const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& y,
                   int64_t first, int64_t last) {
  constexpr int V = 16 / int(sizeof(T));
  const int64_t B = x.size(0), T_ = x.size(1), H = x.size(2), D = x.size(3), h = D / 2;
  const T* xp = static_cast<const T*>(x.raw_data());
  const CS* cp = static_cast<const CS*>(cos.raw_data());
  const CS* sp = static_cast<const CS*>(sin.raw_data());
  bool vec = h % V == 0 && aligned_to(xp, 16) && aligned_to(cp, sizeof(CS) * V) && aligned_to(sp, sizeof(CS) * V) &&
             aligned_to(y.raw_data(), 16);
  for (int d = 0; d < 3; ++d) vec = vec && (x.size(d) == 1 || x.stride(d) % V == 0);
  auto run = [&]<int W>() {
    RotaryShape s;
    s.n = B * T_ * H * (h / W);
    if (s.n == 0) return;
    const bool wide = s.n > int64_t(INT32_MAX);
    s.T = T_;
    s.H = H;
    s.D = D;
    s.first = first;
    s.last = last;
    s.sb = x.stride(0);
    s.st = x.stride(1);
    s.sh = x.stride(2);
    s.per_row = IndexDiv(h / W, wide);
    s.heads = IndexDiv(H, wide);
    s.times = IndexDiv(T_, wide);
    rotary_kernel<T, CS, W, kBackward><<<blocks_for(s.n), 256, 0, stream>>>(xp, cp, sp,
                                                                                     static_cast<T*>(y.raw_data()), s);
    BLU_CUDA_CHECK_LAUNCH();
  };
  if (vec) run.template operator()<V>();
  else run.template operator()<1>();
}

}  // namespace

void rotary_backward_heads_in_place(cudaStream_t stream, const Tensor& g, int64_t first, int64_t count,
                                    const Tensor& cos, const Tensor& sin) {
  BLU_ASSERT(g.is_contiguous() && g.dim() >= 4 && cos.dtype() == DType::f32 && sin.dtype() == DType::f32 &&
                 cos.is_contiguous() && sin.is_contiguous(),
             "rotary_backward_heads_in_place: layouts g ", g.str(), ", cos ", cos.str(), ", sin ", sin.str());
  const int64_t B = g.size(0), T_ = g.size(1), D = g.size(-1), heads = g.numel() / (B * T_ * std::max<int64_t>(D, 1));
  BLU_ASSERT(first >= 0 && count >= 0 && first + count <= heads && D % 2 == 0 && cos.numel() >= T_ * D,
             "rotary_backward_heads_in_place: heads [", first, ", ", first + count, ") of ", heads, ", D ", D);
  if (B * T_ * count == 0) return;
  const Tensor rows = g.alias_with({B, T_, heads, D}, {T_ * heads * D, heads * D, D, 1}, g.offset());
  BLU_DISPATCH_FLOATING(g.dtype(), "rotary_backward_heads_in_place", {
    launch_rotary<dev_t<scalar_t>, float, true>(stream, rows, cos, sin, rows, first, first + count);
  });
}

namespace {

// Inputs (x [B, T, H, D] with unit stride along D, cos, sin [T, D] contiguous, f32 or x's dtype);
// output contiguous. The backward op passes the gradient as x.
template <bool kBackward>
void rotary_embedding_kernel(const KernelCall& c) {
  const Tensor &x = c.in[0], &cos = c.in[1], &sin = c.in[2];
  BLU_ASSERT(x.dim() == 4 && (x.stride(3) == 1 || x.size(3) <= 1) && cos.is_contiguous() && sin.is_contiguous() &&
                 c.out[0].is_contiguous(),
             c.op, ": layouts x ", x.str(), ", cos ", cos.str(), ", sin ", sin.str());
  const int64_t rotate = c.attrs.has("rotate") ? c.attrs.i("rotate") : x.size(2);
  BLU_DISPATCH_FLOATING(x.dtype(), c.op, {
    using T = dev_t<scalar_t>;
    if (cos.dtype() == DType::f32 && !std::is_same_v<T, float>)
      launch_rotary<T, float, kBackward>(stream_of(c.ctx), x, cos, sin, c.out[0], 0, rotate);
    else launch_rotary<T, T, kBackward>(stream_of(c.ctx), x, cos, sin, c.out[0], 0, rotate);
  });
}
BLU_REGISTER_KERNEL(cuda, "rotary_embedding", rotary_embedding_kernel<false>);
BLU_REGISTER_KERNEL(cuda, "rotary_embedding_backward", rotary_embedding_kernel<true>);

// --- silu / swiglu -----------------------------------------------------------------------------

template <typename A>
struct silu_op {
  __device__ __forceinline__ A operator()(A x) const { return mul_rn(x, sigmoid_acc(x)); }
};
template <typename A>
struct silu_backward_op {
  __device__ __forceinline__ A operator()(A g, A x) const { return mul_rn(g, silu_grad_acc(x, sigmoid_acc(x))); }
};
template <typename A>
struct swiglu_op {
  __device__ __forceinline__ A operator()(A a, A b) const { return mul_rn(mul_rn(a, sigmoid_acc(a)), b); }
};

void silu_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using T = dev_t<scalar_t>;
    launch_map<T, T>(stream_of(c.ctx), c.out[0], silu_op<acc_t<T>>{}, c.in[0]);
  });
}
BLU_REGISTER_KERNEL(cuda, "silu", silu_kernel);

// Inputs (g, x).
void silu_backward_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using T = dev_t<scalar_t>;
    launch_map<T, T, T>(stream_of(c.ctx), c.out[0], silu_backward_op<acc_t<T>>{}, c.in[0], c.in[1]);
  });
}
BLU_REGISTER_KERNEL(cuda, "silu_backward", silu_backward_kernel);

// Inputs (gate, up), any layouts.
void swiglu_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using T = dev_t<scalar_t>;
    launch_map<T, T, T>(stream_of(c.ctx), c.out[0], swiglu_op<acc_t<T>>{}, c.in[0], c.in[1]);
  });
}
BLU_REGISTER_KERNEL(cuda, "swiglu", swiglu_kernel);

// One [R, I] operand of swiglu_backward: base pointer and row stride (unit stride along I).
template <typename P>
struct RowOperand {
  P* p;
  int64_t rs;
};

// d_gate = g·up·silu'(gate), d_up = g·silu(gate) over R rows of I / V vectors.
template <typename T, int V>
__global__ void swiglu_backward_kernel(int64_t n, IndexDiv per_row, RowOperand<const T> g, RowOperand<const T> gate,
                                       RowOperand<const T> up, RowOperand<T> dgate, RowOperand<T> dup) {
  using A = acc_t<T>;
  const int64_t vpr = per_row.d;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = per_row.div(i), j = (i - r * vpr) * V;
    const Vec<T, V> gv = *reinterpret_cast<const Vec<T, V>*>(g.p + r * g.rs + j);
    const Vec<T, V> av = *reinterpret_cast<const Vec<T, V>*>(gate.p + r * gate.rs + j);
    const Vec<T, V> bv = *reinterpret_cast<const Vec<T, V>*>(up.p + r * up.rs + j);
    Vec<T, V> da, db;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A gg = to_acc(gv.v[e]), a = to_acc(av.v[e]), b = to_acc(bv.v[e]);
      const A s = sigmoid_acc(a);
      da.v[e] = from_acc<T>(mul_rn(mul_rn(gg, b), silu_grad_acc(a, s)));
      db.v[e] = from_acc<T>(mul_rn(gg, mul_rn(a, s)));
    }
    *reinterpret_cast<Vec<T, V>*>(dgate.p + r * dgate.rs + j) = da;
    *reinterpret_cast<Vec<T, V>*>(dup.p + r * dup.rs + j) = db;
  }
}

// The row stride of a row-strided operand (ops/swiglu.cpp's row_stride: leading dims that walk
// rows of one stride, unit stride along the last dim).
int64_t row_stride_of(const Tensor& t) {
  if (t.dim() == 0) return 1;
  int64_t rs = -1;
  for (int64_t d = t.dim() - 2; d >= 0 && rs < 0; --d)
    if (t.size(d) != 1) rs = t.stride(d);
  return rs < 0 ? t.size(-1) : rs;
}

// Inputs (g, gate, up), row-strided; outputs d_gate, d_up, or (attr joined) one [..., 2I] buffer
// with d_gate in columns [0, I) and d_up in [I, 2I).
void swiglu_backward_kernel_launch(const KernelCall& c) {
  const Tensor &g = c.in[0], &gate = c.in[1], &up = c.in[2];
  const int64_t I = gate.dim() == 0 ? 1 : gate.size(-1), R = I == 0 ? 0 : gate.numel() / I;
  if (R == 0) return;
  const bool joined = c.attrs.b("joined");
  BLU_DISPATCH_FLOATING(gate.dtype(), c.op, {
    using T = dev_t<scalar_t>;
    constexpr int V = 16 / int(sizeof(T));
    T* dg = static_cast<T*>(c.out[0].raw_data());
    T* du = joined ? dg + I : static_cast<T*>(c.out[1].raw_data());
    const int64_t drs = joined ? 2 * I : I;
    const RowOperand<const T> ops[3] = {{static_cast<const T*>(g.raw_data()), row_stride_of(g)},
                                        {static_cast<const T*>(gate.raw_data()), row_stride_of(gate)},
                                        {static_cast<const T*>(up.raw_data()), row_stride_of(up)}};
    bool vec = I % V == 0 && drs % V == 0 && aligned_to(dg, 16) && aligned_to(du, 16);
    for (const auto& o : ops) vec = vec && o.rs % V == 0 && aligned_to(o.p, 16);
    auto run = [&]<int W>() {
      const int64_t n = R * (I / W);
      const IndexDiv per_row(I / W, n > int64_t(INT32_MAX));
      swiglu_backward_kernel<T, W><<<blocks_for(n), 256, 0, stream_of(c.ctx)>>>(n, per_row, ops[0], ops[1], ops[2],
                                                                               RowOperand<T>{dg, drs},
                                                                               RowOperand<T>{du, drs});
      BLU_CUDA_CHECK_LAUNCH();
    };
    if (vec) run.template operator()<V>();
    else run.template operator()<1>();
  });
}
BLU_REGISTER_KERNEL(cuda, "swiglu_backward", swiglu_backward_kernel_launch);

}  // namespace

}  // namespace blu::cuda
