// backend/cuda/copy: CUDA kernels for the copy family — to_device (host <-> device <-> device),
// copy_, clone, cast — and the factories empty, fill_, arange. Conversions follow the CPU kernels
// bit for bit (backend/cpu/elementwise.cpp, core/dtype.h): a value goes through the source's
// arithmetic type (float for bf16/f16) and is then converted to the destination; 16-bit floats
// round to nearest even, NaN becoming the CPU's quiet NaN; double -> bf16/f16 goes through float.
// Float -> integer conversions that overflow are undefined in C++; here they give what x86 gives
// the CPU reference (the "integer indefinite" value), so both backends agree on every input.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"
#include "blu/backend/cuda/round16.cuh"
#include "blu/backend/cuda/runtime.h"
#include "blu/backend/cuda/strided.cuh"
#include "blu/memory/cuda_allocator.h"

namespace blu::cuda {

namespace {

// Storage types as kernels see them: the 16-bit floats are their bits.
struct Bf16Bits {
  uint16_t bits;
};
struct F16Bits {
  uint16_t bits;
};
template <typename T> struct device_type { using type = T; };
template <> struct device_type<bf16> { using type = Bf16Bits; };
template <> struct device_type<f16> { using type = F16Bits; };
template <typename T> using device_t = typename device_type<T>::type;

// The arithmetic type of a storage type (backend/cpu/loops.h acc_t).
template <typename T> struct acc_type { using type = T; };
template <> struct acc_type<Bf16Bits> { using type = float; };
template <> struct acc_type<F16Bits> { using type = float; };
template <typename T> using acc_t = typename acc_type<T>::type;

__device__ __forceinline__ float bits_to_float(uint32_t u) { return __uint_as_float(u); }

__device__ __forceinline__ float to_acc(Bf16Bits x) { return bits_to_float(uint32_t(x.bits) << 16); }
__device__ __forceinline__ float to_acc(F16Bits x) {
  // NaN keeps its payload, as core/dtype's f16::to_float does (the hardware may canonicalise it).
  if ((x.bits & 0x7c00u) == 0x7c00u && (x.bits & 0x3ffu))
    return bits_to_float((uint32_t(x.bits & 0x8000u) << 16) | 0x7f800000u | (uint32_t(x.bits & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(x.bits));
}
template <typename T>
__device__ __forceinline__ T to_acc(T x) {
  return x;
}

// double <-> float with x86's NaN handling (payload kept, quiet bit set); the hardware would
// return a canonical NaN instead.
__device__ __forceinline__ float narrow_to_float(double d) {
  if (d != d) {
    const uint64_t u = uint64_t(__double_as_longlong(d));
    return bits_to_float(uint32_t(u >> 32 & 0x80000000u) | 0x7fc00000u | uint32_t(u >> 29 & 0x3fffffu));
  }
  return __double2float_rn(d);
}
__device__ __forceinline__ double widen_to_double(float f) {
  if (f != f) {
    const uint64_t u = __float_as_uint(f);
    return __longlong_as_double(int64_t((u & 0x80000000u) << 32 | 0x7ff8000000000000ull | (u & 0x3fffffu) << 29));
  }
  return double(f);
}

// float -> 16-bit, as core/dtype.h rounds (round16.cuh).
__device__ __forceinline__ Bf16Bits make_bf16(float f) { return Bf16Bits{bf16_bits_rn(f)}; }
__device__ __forceinline__ F16Bits make_f16(float f) { return F16Bits{f16_bits_rn(f)}; }

// Truncation to a signed integer; NaN and out-of-range give the minimum (x86 cvtt*2si).
template <typename I, typename F>
__device__ __forceinline__ I x86_truncate(F x) {
  constexpr F lim = F(uint64_t(1) << (sizeof(I) * 8 - 1));  // 2^31 or 2^63, exact in float/double
  if (!(x >= -lim && x < lim)) return I(uint64_t(1) << (sizeof(I) * 8 - 1));
  return I(x);
}

// The CPU's Out(acc) for an arithmetic value `a` (float, double or an integer).
template <typename Out, typename A>
__device__ __forceinline__ Out from_acc(A a) {
  if constexpr (std::is_same_v<Out, bool>) {
    return a != A(0);
  } else if constexpr (std::is_same_v<Out, Bf16Bits> || std::is_same_v<Out, F16Bits>) {
    float f;
    if constexpr (std::is_same_v<A, double>)
      f = narrow_to_float(a);
    else if constexpr (std::is_same_v<A, float>)
      f = a;
    else
      f = float(a);  // integers round to nearest, like the CPU's implicit conversion
    if constexpr (std::is_same_v<Out, Bf16Bits>)
      return make_bf16(f);
    else
      return make_f16(f);
  } else if constexpr (std::is_same_v<Out, float> && std::is_same_v<A, double>) {
    return narrow_to_float(a);
  } else if constexpr (std::is_same_v<Out, double> && std::is_same_v<A, float>) {
    return widen_to_double(a);
  } else if constexpr (std::is_floating_point_v<A> && std::is_integral_v<Out>) {
    if constexpr (sizeof(Out) == 8)
      return Out(x86_truncate<int64_t>(a));
    else
      return Out(x86_truncate<int32_t>(a));  // i32, and u8 as the low byte of an i32 (as gcc does)
  } else {
    return Out(a);
  }
}

template <typename Out, typename In>
__device__ __forceinline__ Out convert(In x) {
  if constexpr (std::is_same_v<In, bool> && !std::is_same_v<Out, bool>)
    return from_acc<Out>(acc_t<Out>(x ? 1 : 0));
  else
    return from_acc<Out>(to_acc(x));
}

constexpr int kThreads = 256;

// dst[dl(i)] = convert(src[sl(i)]) for i < n.
template <typename Out, typename In>
__global__ void convert_kernel(Out* __restrict__ dst, StridedLayout dl, const In* __restrict__ src, StridedLayout sl,
                               int64_t n, bool contiguous) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (contiguous)
      dst[i] = convert<Out>(src[i]);
    else
      dst[dl.offset(i)] = convert<Out>(src[sl.offset(i)]);
  }
}

// Same dtype: moves the bits (as the unsigned integer of the element's width).
template <typename U>
__global__ void gather_kernel(U* __restrict__ dst, StridedLayout dl, const U* __restrict__ src, StridedLayout sl, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[dl.offset(i)] = src[sl.offset(i)];
}

template <typename U>
__global__ void fill_kernel(U* __restrict__ dst, StridedLayout dl, U value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[dl.offset(i)] = value;
}

template <typename Out>
__global__ void arange_kernel(Out* __restrict__ dst, double start, double step, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_acc<Out>(__dadd_rn(start, __dmul_rn(double(i), step)));  // no FMA: as the CPU rounds
}

// Runs f with U = the unsigned type of `size` bytes.
template <typename F>
void with_width(size_t size, F&& f) {
  switch (size) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    case 8: f(uint64_t{}); break;
    default: BLU_ASSERT(false, "element size ", size);
  }
}

// dst (any layout, on the device) = src (any layout broadcasting to dst, on the same device),
// converting dtypes. Launched on `stream`.
void strided_copy(cudaStream_t stream, const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const auto layouts = coalesced_layouts<2>(dst.shape(), {dst.strides(), broadcast_strides_to(src, dst.shape())});
  const StridedLayout& dl = layouts[0];
  const StridedLayout& sl = layouts[1];
  const bool contiguous = dl.contiguous() && sl.contiguous();
  if (dst.dtype() == src.dtype() && contiguous) {
    BLU_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), dst.nbytes(), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (copy_through_map(stream, dst, src)) return;  // 16-byte vectors where the layouts allow
  if (dst.dtype() == src.dtype()) {
    with_width(dst.itemsize(), [&](auto u) {
      using U = decltype(u);
      gather_kernel<U><<<grid_for(n, kThreads), kThreads, 0, stream>>>(static_cast<U*>(dst.raw_data()), dl,
                                                                      static_cast<const U*>(src.raw_data()), sl, n);
      BLU_CUDA_CHECK_LAUNCH();
    });
    return;
  }
  BLU_DISPATCH_ALL(dst.dtype(), "copy", {
    using Out = device_t<scalar_t>;
    BLU_DISPATCH_ALL(src.dtype(), "copy", {
      using In = device_t<scalar_t>;
      convert_kernel<Out, In><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
          static_cast<Out*>(dst.raw_data()), dl, static_cast<const In*>(src.raw_data()), sl, n, contiguous);
      BLU_CUDA_CHECK_LAUNCH();
    });
  });
}

// copy_(dst, src), clone(x), cast(x): in[1] (or in[0]) into out[0].
void copy_kernel(const KernelCall& c) {
  const Tensor& src = c.in.size() > 1 ? c.in[1] : c.in[0];
  BLU_CHECK(src.device() == c.out[0].device(), c.op, ": source on ", src.device(), ", destination on ",
            c.out[0].device(), " (use to_device)");
  strided_copy(stream_of(c.ctx), c.out[0], src);
}

void empty_kernel(const KernelCall&) {}

void fill_kernel_host(const KernelCall& c) {
  const Tensor& t = c.out[0];
  const int64_t n = t.numel();
  if (n == 0) return;
  // The element's bits, made on the host by the very conversion the CPU kernel uses.
  uint64_t pattern = 0;
  const double v = c.attrs.f("value");
  BLU_DISPATCH_ALL(t.dtype(), "fill_", {
    const scalar_t x = scalar_t(v);
    std::memcpy(&pattern, &x, sizeof x);
  });
  cudaStream_t stream = stream_of(c.ctx);
  const size_t w = t.itemsize();
  bool bytes_alike = true;
  for (size_t b = 1; b < w; ++b) bytes_alike &= (pattern >> 8 * b & 0xff) == (pattern & 0xff);
  if (t.is_contiguous() && bytes_alike) {
    BLU_CUDA_CHECK(cudaMemsetAsync(t.raw_data(), int(pattern & 0xff), t.nbytes(), stream));
    return;
  }
  const StridedLayout dl = coalesced_layouts<1>(t.shape(), {t.strides()})[0];
  with_width(w, [&](auto u) {
    using U = decltype(u);
    fill_kernel<U><<<grid_for(n, kThreads), kThreads, 0, stream>>>(static_cast<U*>(t.raw_data()), dl, U(pattern), n);
    BLU_CUDA_CHECK_LAUNCH();
  });
}

void arange_kernel_host(const KernelCall& c) {
  const Tensor& t = c.out[0];
  const int64_t n = t.numel();
  if (n == 0) return;
  const double start = c.attrs.f("start"), step = c.attrs.f("step");
  cudaStream_t stream = stream_of(c.ctx);
  BLU_DISPATCH_ALL(t.dtype(), "arange", {
    using Out = device_t<scalar_t>;
    arange_kernel<Out><<<grid_for(n, kThreads), kThreads, 0, stream>>>(static_cast<Out*>(t.raw_data()), start, step, n);
    BLU_CUDA_CHECK_LAUNCH();
  });
}

// Makes `device` current for a scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : prev_(current_device()) {
    if (prev_ != device) set_device(device);
  }
  ~DeviceGuard() {
    if (current_device_nothrow() != prev_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  static int current_device_nothrow() {
    int d = -1;
    return cudaGetDevice(&d) == cudaSuccess ? d : -1;
  }
  int prev_;
};

// Host copy of any layout into contiguous `dst` (element by element, innermost dim in a run).
void host_gather(void* dst, const Tensor& src) {
  const size_t w = src.itemsize();
  const int64_t n = src.numel();
  if (src.is_contiguous()) {
    std::memcpy(dst, src.raw_data(), size_t(n) * w);
    return;
  }
  const StridedLayout sl = coalesced_layouts<1>(src.shape(), {src.strides()})[0];
  with_width(w, [&](auto u) {
    using U = decltype(u);
    const U* s = static_cast<const U*>(src.raw_data());
    U* d = static_cast<U*>(dst);
    const int nd = sl.ndim;
    const int64_t inner = nd ? sl.shape[nd - 1] : 1, istride = nd ? sl.strides[nd - 1] : 0;
    int64_t coord[StridedLayout::kMaxDims] = {};
    int64_t base = 0;
    for (int64_t row = 0; row * inner < n; ++row) {
      for (int64_t j = 0; j < inner; ++j) d[row * inner + j] = s[base + j * istride];
      for (int k = nd - 2; k >= 0; --k) {  // next row
        base += sl.strides[k];
        if (++coord[k] < sl.shape[k]) break;
        base -= coord[k] * sl.strides[k];
        coord[k] = 0;
      }
    }
  });
}

// A contiguous device copy of `src` (itself when already contiguous), made on `stream` into a
// slice of `ws`.
const void* contiguous_on_device(const Tensor& src, cudaStream_t stream, Workspace& ws) {
  if (src.is_contiguous()) return src.raw_data();
  void* p = ws.take(src.nbytes());
  auto storage = std::make_shared<Storage>(DataPtr(p, src.nbytes(), src.device(), nullptr, nullptr));
  strided_copy(stream, Tensor(storage, src.shape(), contiguous_strides(src.shape()), 0, src.dtype()), src);
  return p;
}

void to_device_kernel(const KernelCall& c) {
  const Tensor& src = c.in[0];
  const Tensor& dst = c.out[0];
  BLU_ASSERT(dst.is_contiguous() && dst.dtype() == src.dtype() && dst.shape() == src.shape(), "to_device: output ",
             dst.str(), " for input ", src.str());
  const size_t nbytes = dst.nbytes();
  if (nbytes == 0) return;
  const Device from = src.device(), to = dst.device();

  if (from.is_cpu()) {
    // Host -> device through pinned staging: the DMA runs asynchronously on the current stream,
    // and the staging block returns to the pinned cache once the stream has passed the copy.
    BLU_ASSERT(to.is_cuda(), "to_device: ", from, " -> ", to);
    DeviceGuard g(to.index);
    cudaStream_t stream = stream_of(c.ctx);
    PinnedAllocator& pinned = pinned_allocator();
    DataPtr staging = pinned.allocate(nbytes);
    host_gather(staging.get(), src);
    BLU_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), staging.get(), nbytes, cudaMemcpyHostToDevice, stream));
    pinned.record_stream(staging.get(), stream);
    return;
  }

  DeviceGuard g(from.index);
  const cudaStream_t from_stream = stream_of(c.ctx);  // the context of the source's device
  if (to.is_cpu()) {
    // Device -> host: the host reads the result as soon as we return, so wait for the stream.
    cudaStream_t stream = from_stream;
    const void* p = contiguous_on_device(src, stream, *c.ctx.scratch);
    BLU_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), p, nbytes, cudaMemcpyDeviceToHost, stream));
    BLU_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  if (from == to) {
    strided_copy(from_stream, dst, src);
    return;
  }
  // Between two devices (rare: data parallelism uses NCCL). Ordered conservatively: the source
  // stream finishes first, the copy runs on the destination's stream and is waited for.
  const void* p = contiguous_on_device(src, from_stream, *c.ctx.scratch);
  BLU_CUDA_CHECK(cudaStreamSynchronize(from_stream));
  DeviceGuard g2(to.index);
  cudaStream_t stream = stream_of(current_context(to));
  BLU_CUDA_CHECK(cudaMemcpyPeerAsync(dst.raw_data(), to.index, p, from.index, nbytes, stream));
  BLU_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace

BLU_REGISTER_KERNEL(cuda, "to_device", to_device_kernel);
BLU_REGISTER_KERNEL(cuda, "copy_", copy_kernel);

namespace {

// --- copy_many: many contiguous same-dtype copies in one launch per kCopyMaxPairs ---
// Block b of pair t copies bytes [k·kCopyChunk, (k+1)·kCopyChunk) of it, k = b − first_block[t],
// in 16-byte vectors when both pointers allow, else 4-byte words, else bytes (uniform per pair).
constexpr int kCopyThreads = 256;
constexpr int kCopyMaxPairs = 96;
constexpr int64_t kCopyChunk = 64 << 10;  // bytes a block copies

struct CopyTable {
  const char* src[kCopyMaxPairs];
  char* dst[kCopyMaxPairs];
  int64_t bytes[kCopyMaxPairs];
  int32_t first_block[kCopyMaxPairs + 1];
  int32_t count;
};
static_assert(sizeof(CopyTable) <= 4000, "kernel parameters are limited to 4 KiB");

template <typename W>
__device__ __forceinline__ void copy_words(char* dst, const char* src, int64_t n) {
  const int64_t words = n / int64_t(sizeof(W));
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x)
    reinterpret_cast<W*>(dst)[i] = reinterpret_cast<const W*>(src)[i];
  for (int64_t i = words * int64_t(sizeof(W)) + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void __launch_bounds__(kCopyThreads) copy_many_cuda_kernel(CopyTable tab) {
  const int t = owning_tensor(tab.first_block, tab.count, int(blockIdx.x));
  const int64_t start = int64_t(int(blockIdx.x) - tab.first_block[t]) * kCopyChunk;
  const int64_t n = min(kCopyChunk, tab.bytes[t] - start);
  char* d = tab.dst[t] + start;
  const char* s = tab.src[t] + start;
  const uintptr_t align = reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s);
  if (align % 16 == 0) copy_words<uint4>(d, s, n);
  else if (align % 4 == 0) copy_words<uint32_t>(d, s, n);
  else copy_words<char>(d, s, n);
}

void copy_many_kernel(const KernelCall& c) {
  const size_t n = c.in.size() / 2;
  cudaStream_t stream = stream_of(c.ctx);
  for (size_t first = 0; first < n; first += kCopyMaxPairs) {
    CopyTable tab{};
    tab.count = int32_t(std::min<size_t>(kCopyMaxPairs, n - first));
    int32_t blocks = 0;
    for (int i = 0; i < tab.count; ++i) {
      const Tensor &d = c.in[first + size_t(i)], &s = c.in[n + first + size_t(i)];
      BLU_ASSERT(d.is_contiguous() && s.is_contiguous(), "copy_many: non-contiguous pair (ops/view.cpp copies it apart)");
      tab.dst[i] = static_cast<char*>(d.raw_data());
      tab.src[i] = static_cast<const char*>(s.raw_data());
      tab.bytes[i] = int64_t(d.nbytes());
      tab.first_block[i] = blocks;
      blocks += int32_t((tab.bytes[i] + kCopyChunk - 1) / kCopyChunk);
    }
    tab.first_block[tab.count] = blocks;
    copy_many_cuda_kernel<<<unsigned(blocks), kCopyThreads, 0, stream>>>(tab);
    BLU_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

BLU_REGISTER_KERNEL(cuda, "copy_many", copy_many_kernel);
BLU_REGISTER_KERNEL(cuda, "clone", copy_kernel);
BLU_REGISTER_KERNEL(cuda, "cast", copy_kernel);
BLU_REGISTER_KERNEL(cuda, "empty", empty_kernel);
BLU_REGISTER_KERNEL(cuda, "fill_", fill_kernel_host);
BLU_REGISTER_KERNEL(cuda, "arange", arange_kernel_host);

}  // namespace blu::cuda
