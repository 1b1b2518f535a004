// memory/cuda_allocator and backend/cuda/copy on a real GPU: tensors from the caching allocator,
// no raw cudaMalloc once warm, statistics, record_stream, out-of-memory reporting, pinned memory;
// to_device round trips of every dtype with non-contiguous inputs (bit-exact), and cast, copy_,
// fill_, arange on the GPU bit-exact against the CPU kernels.
// Run: ctest -L cuda, or build-cuda/tests/test_cuda --gtest_filter='CudaAllocator*:CudaCopy*'.
#include <gtest/gtest.h>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/core/exec_context.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/optim/state_io.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::kGPU;
constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                DType::i32, DType::i64, DType::u8,   DType::b8};

std::string hex_bytes(const void* p, size_t n) {
  std::ostringstream os;
  os << "0x" << std::hex;
  for (size_t i = n; i-- > 0;) {  // little endian: most significant byte last in memory
    const unsigned b = static_cast<const uint8_t*>(p)[i];
    os << (b < 16 ? "0" : "") << b;
  }
  return os.str();
}

// Compares two CPU tensors of one dtype byte for byte; reports the first mismatches.
::testing::AssertionResult bits_equal(const Tensor& want, const Tensor& got, const Tensor* source = nullptr) {
  if (want.dtype() != got.dtype() || want.shape() != got.shape())
    return ::testing::AssertionFailure() << "expected " << want.str() << ", got " << got.str();
  const Tensor a = contiguous(want), b = contiguous(got);
  const Tensor s = source ? contiguous(*source) : Tensor();
  const size_t w = a.itemsize();
  const auto* pa = static_cast<const uint8_t*>(a.raw_data());
  const auto* pb = static_cast<const uint8_t*>(b.raw_data());
  int bad = 0;
  std::ostringstream os;
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * w, pb + i * w, w) == 0) continue;
    if (++bad <= 10) {
      os << "\n  [" << i << "] cpu " << hex_bytes(pa + i * w, w) << " gpu " << hex_bytes(pb + i * w, w);
      if (source)
        os << " from " << s.dtype() << " " << hex_bytes(static_cast<const uint8_t*>(s.raw_data()) + i * s.itemsize(), s.itemsize())
           << " (" << to_vector(narrow(flatten(s), 0, i, 1))[0] << ")";
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << a.numel() << " elements of " << a.dtype()
                                       << " differ; first ones:" << os.str();
}

// Random bits for every dtype (bool: 0 or 1; floats include NaNs with payloads, infs, subnormals).
Tensor random_bits(const Shape& shape, DType dtype, uint32_t seed) {
  Tensor t = empty(shape, dtype);
  std::mt19937_64 rng(seed);
  auto* p = static_cast<uint8_t*>(t.raw_data());
  if (dtype == DType::b8) {
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = uint8_t(rng() & 1);
  } else {
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(rng());
  }
  return t;
}

// ----------------------------------------------------------------------------------------------
// Allocator

TEST(CudaAllocator, TensorsComeFromTheDevice) {
  SKIP_WITHOUT_CUDA();
  const CachingAllocatorStats s0 = cuda::memory_stats(0);
  Tensor t = empty({1000}, DType::f32, kGPU);
  ASSERT_TRUE(t.device().is_cuda());
  cudaPointerAttributes attr{};
  BLU_CUDA_CHECK(cudaPointerGetAttributes(&attr, t.raw_data()));
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 512, 0u);
  const CachingAllocatorStats s1 = cuda::memory_stats(0);
  EXPECT_EQ(s1.requested_bytes - s0.requested_bytes, 4000);
  EXPECT_EQ(s1.allocs - s0.allocs, 1);
  const AllocatorStats a = allocator_for(kGPU).stats();
  EXPECT_EQ(a.current_bytes, s1.requested_bytes);
  EXPECT_EQ(a.reserved_bytes, s1.reserved_bytes);
  t = Tensor();
  EXPECT_EQ(cuda::memory_stats(0).requested_bytes, s0.requested_bytes);
  EXPECT_EQ(cuda::memory_stats(0).frees - s0.frees, 1);
}

TEST(CudaAllocator, WarmLoopMakesNoRawAllocations) {
  SKIP_WITHOUT_CUDA();
  auto step = [] {
    std::vector<Tensor> ts;
    for (int64_t n : {int64_t(10), int64_t(1) << 12, int64_t(1) << 18, int64_t(3) << 20, int64_t(50'000'000)})
      ts.push_back(empty({n}, DType::f32, kGPU));
    ts.push_back(zeros({768, 3072}, DType::bf16, kGPU));
    ts.push_back(clone(ts.back()));
  };
  step();
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  const CachingAllocatorStats s0 = cuda::memory_stats(0);
  for (int i = 0; i < 20; ++i) step();
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  const CachingAllocatorStats s1 = cuda::memory_stats(0);
  EXPECT_EQ(s1.raw_allocs, s0.raw_allocs) << cuda::memory_snapshot();
  EXPECT_EQ(s1.reserved_bytes, s0.reserved_bytes);
  EXPECT_EQ(s1.allocs - s0.allocs, 20 * 7);
}

TEST(CudaAllocator, StatsPeakEmptyCacheSnapshot) {
  SKIP_WITHOUT_CUDA();
  cuda::reset_peak_memory_stats(0);
  const CachingAllocatorStats s0 = cuda::memory_stats(0);
  {
    Tensor big = empty({int64_t(64) << 20}, DType::u8, kGPU);  // 64 MiB: a large segment
    const CachingAllocatorStats s1 = cuda::memory_stats(0);
    EXPECT_EQ(s1.requested_peak, s0.requested_bytes + (int64_t(64) << 20));
    EXPECT_GE(s1.reserved_bytes, s0.reserved_bytes);
    const auto j = nlohmann::json::parse(cuda::memory_snapshot());
    ASSERT_TRUE(j.contains("cuda:0")) << j.dump();
    bool found = false;
    for (const auto& seg : j["cuda:0"])
      for (const auto& b : seg["blocks"])
        found |= b["state"] == "allocated" && b["requested"].get<int64_t>() == (int64_t(64) << 20);
    EXPECT_TRUE(found) << j.dump();
  }
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  const CachingAllocatorStats s2 = cuda::memory_stats(0);
  EXPECT_EQ(s2.requested_bytes, s0.requested_bytes);
  EXPECT_GE(s2.free_bytes, int64_t(64) << 20) << "the block stays cached";
  cuda::empty_cache();
  const CachingAllocatorStats s3 = cuda::memory_stats(0);
  EXPECT_LE(s3.reserved_bytes, s2.reserved_bytes - (int64_t(64) << 20));
  EXPECT_GT(s3.raw_frees, s2.raw_frees);
  EXPECT_EQ(s3.reserved_bytes - s3.allocated_bytes, s3.free_bytes);
}

// Note [Optimizer state in one buffer]: the state's buffer is made after the allocator's free
// segments go back, so the first update, which comes after the first backward freed its
// activations, does not hold a cached activation segment and the state's own at once. Peak
// reserved (what torch.cuda.max_memory_reserved reports) follows the segments.
constexpr int64_t kMiB = int64_t(1) << 20;

// An "activation" freed with its segment still cached: larger than any free block the earlier
// tests' live segments leave (by `margin`), so it had a segment of its own. Returns its bytes; s0
// and s1 are the allocator's statistics before it was made (cache emptied, peaks reset) and after
// it was freed.
int64_t cache_a_freed_activation(int64_t margin, CachingAllocatorStats& s0, CachingAllocatorStats& s1) {
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::empty_cache();
  cuda::reset_peak_memory_stats(0);
  s0 = cuda::memory_stats(0);
  const int64_t act = (s0.largest_free_block / kMiB + margin) * kMiB;
  { Tensor activation = empty({act}, DType::u8, kGPU); }
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  s1 = cuda::memory_stats(0);
  return act;
}

TEST(CudaAllocator, OptimizerStateIsMadeAfterTheCacheGoesBack) {
  SKIP_WITHOUT_CUDA();
  const Tensor like = empty({8 * kMiB}, DType::f32, kGPU);  // a 32 MiB parameter
  CachingAllocatorStats s0, s1;
  const int64_t act = cache_a_freed_activation(64, s0, s1);
  ASSERT_GE(s1.reserved_bytes, s0.reserved_bytes + act);
  const std::vector<Tensor> state = optim::detail::packed_zeros({like}, "test state");
  const CachingAllocatorStats s2 = cuda::memory_stats(0);
  // The activation's segment went back; kept, it would still be reserved beside the state.
  EXPECT_LE(s2.reserved_bytes, s1.reserved_bytes - act + 34 * kMiB);
  EXPECT_EQ(allocator_for(kGPU).stats().peak_reserved_bytes, s2.reserved_peak);
  EXPECT_GE(s2.reserved_peak, s0.reserved_bytes + act);  // the activation's segment, while it lived
}

// A growing workspace (core/exec_context.h) gets a segment of its own: the cached segment of a
// freed activation larger than it goes back first instead of holding the workspace at its start.
TEST(CudaAllocator, WorkspaceGrowsIntoASegmentOfItsOwn) {
  SKIP_WITHOUT_CUDA();
  CachingAllocatorStats s0, s1;
  const int64_t act = cache_a_freed_activation(256, s0, s1);
  ASSERT_GE(s1.reserved_bytes, s0.reserved_bytes + act);
  Workspace ws(kGPU);
  ws.reserve(size_t(40 * kMiB));
  const CachingAllocatorStats s2 = cuda::memory_stats(0);
  EXPECT_LE(s2.reserved_bytes, s1.reserved_bytes - act + 42 * kMiB);
}

TEST(CudaAllocator, OutOfMemoryReportsAndRecovers) {
  SKIP_WITHOUT_CUDA();
  try {
    Tensor huge = empty({int64_t(1) << 50}, DType::u8, kGPU);  // 1 PiB
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cuda:0: out of memory allocating 1024.00 TiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("reserved:"), std::string::npos) << msg;
    EXPECT_NE(msg.find("largest free block"), std::string::npos) << msg;
  }
  EXPECT_GE(cuda::memory_stats(0).num_ooms, 1);
  BLU_CUDA_CHECK(cudaGetLastError());  // the failed cudaMalloc left no sticky error
  Tensor t = ones({16}, DType::f32, kGPU);
  EXPECT_EQ(to_vector(to_device(t, kCPU))[15], 1.0);
}

// A stream kept busy by a host callback until `release` is set.
struct BlockedStream {
  cuda::Stream stream;
  std::atomic<bool> release{false};
  BlockedStream() {
    BLU_CUDA_CHECK(cudaLaunchHostFunc(
        stream.get(),
        [](void* p) {
          auto* flag = static_cast<std::atomic<bool>*>(p);
          while (!flag->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        },
        &release));
  }
  ~BlockedStream() {
    release = true;
    cudaStreamSynchronize(stream.get());
  }
};

TEST(CudaAllocator, RecordStreamHoldsTheBlockUntilTheStreamPasses) {
  SKIP_WITHOUT_CUDA();
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::empty_cache();  // no cached block of the size below but the one under test
  BlockedStream side;
  Tensor t = empty({int64_t(8) << 20}, DType::u8, kGPU);  // its own large block
  void* p = t.raw_data();
  cuda::record_stream(t, side.stream.get());
  t = Tensor();
  EXPECT_EQ(cuda::memory_stats(0).pending_blocks, 1);
  Tensor u = empty({int64_t(8) << 20}, DType::u8, kGPU);
  EXPECT_NE(u.raw_data(), p) << "reused while the side stream may still read it";
  side.release = true;
  side.stream.synchronize();
  Tensor v = empty({int64_t(8) << 20}, DType::u8, kGPU);
  EXPECT_EQ(v.raw_data(), p) << "the block comes back once the side stream passed its event";
  EXPECT_EQ(cuda::memory_stats(0).pending_blocks, 0);
}

TEST(CudaAllocator, BlocksAreBoundToTheCurrentStream) {
  SKIP_WITHOUT_CUDA();
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::empty_cache();
  cuda::Stream other;
  void* p = nullptr;
  {
    Tensor t = empty({int64_t(6) << 20}, DType::u8, kGPU);
    p = t.raw_data();
  }
  {
    cuda::StreamGuard g(other.get());
    Tensor u = empty({int64_t(6) << 20}, DType::u8, kGPU);
    EXPECT_NE(u.raw_data(), p) << "a block freed on the default stream went to another stream";
  }
  Tensor w = empty({int64_t(6) << 20}, DType::u8, kGPU);
  EXPECT_EQ(w.raw_data(), p);
  other.synchronize();
}

TEST(CudaAllocator, PinnedHostMemory) {
  SKIP_WITHOUT_CUDA();
  cuda::PinnedAllocator& pa = cuda::pinned_allocator();
  EXPECT_TRUE(pa.device().is_cpu());
  const AllocatorStats s0 = pa.stats();
  {
    DataPtr p = pa.allocate(3 << 20);
    cudaPointerAttributes attr{};
    BLU_CUDA_CHECK(cudaPointerGetAttributes(&attr, p.get()));
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    EXPECT_EQ(pa.stats().current_bytes - s0.current_bytes, 3 << 20);
    std::memset(p.get(), 7, 3 << 20);  // host-writable
  }
  EXPECT_EQ(pa.stats().current_bytes, s0.current_bytes);
  // Host -> device copies stage through it and return the staging block.
  const int64_t raw0 = cuda::pinned_memory_stats().raw_allocs;
  for (int i = 0; i < 10; ++i) {
    Tensor g = to_device(ones({1 << 16}, DType::f32), kGPU);
    BLU_CUDA_CHECK(cudaDeviceSynchronize());  // the staging block's event completes
  }
  EXPECT_LE(cuda::pinned_memory_stats().raw_allocs - raw0, 1) << cuda::memory_snapshot();
}

// ----------------------------------------------------------------------------------------------
// Copies

// Non-contiguous views of a contiguous CPU tensor of shape [6, 5, 4].
std::vector<std::pair<std::string, Tensor>> views_of(const Tensor& t) {
  return {{"contiguous", t},
          {"transpose(0,2)", transpose(t, 0, 2)},
          {"narrow(1,1,3)", narrow(t, 1, 1, 3)},
          {"permute(1,2,0)+narrow", narrow(permute(t, {1, 2, 0}), 2, 2, 3)},
          {"select+expand", expand(unsqueeze(select(t, 2, 1), 0), {3, 6, 5})},
          {"scalar", select(select(select(t, 0, 4), 0, 3), 0, 2)}};
}

TEST(CudaCopy, RoundTripEveryDtypeBitExact) {
  SKIP_WITHOUT_CUDA();
  uint32_t seed = 1;
  for (DType dt : kAllDTypes) {
    const Tensor base = random_bits({6, 5, 4}, dt, seed++);
    for (const auto& [name, v] : views_of(base)) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + name);
      const Tensor g = to_device(v, kGPU);  // host gather into pinned staging
      ASSERT_TRUE(g.device().is_cuda());
      EXPECT_EQ(g.shape(), v.shape());
      EXPECT_TRUE(bits_equal(v, to_device(g, kCPU)));
    }
    // Non-contiguous on the GPU side: gather kernel before the device -> host copy.
    const Tensor g = to_device(base, kGPU);
    for (const auto& [name, gv] : views_of(g)) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " gpu-side " + name);
      Tensor want;
      for (const auto& [n2, cv] : views_of(base))
        if (n2 == name) want = cv;
      EXPECT_TRUE(bits_equal(want, to_device(gv, kCPU)));
      EXPECT_TRUE(bits_equal(want, to_device(clone(gv), kCPU)));  // device -> device gather
    }
  }
}

TEST(CudaCopy, EmptyAndLargeTransfers) {
  SKIP_WITHOUT_CUDA();
  Tensor e = to_device(empty({0, 3}, DType::f32), kGPU);
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(to_device(e, kCPU).shape(), (Shape{0, 3}));
  const Tensor big = random_bits({int64_t(24) << 20}, DType::u8, 99);  // larger than a small segment
  EXPECT_TRUE(bits_equal(big, to_device(to_device(big, kGPU), kCPU)));
}

// Source values for casts: edge cases (as f64, cast to the source dtype on the CPU) then random bits.
Tensor cast_source(DType src, uint32_t seed) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> edges = {0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 0.49999997, 127.0, 128.0, 255.0, 255.9,
                               256.0, 300.0, -300.0, -129.0, 65504.0, 65519.99, 65520.0, 1e10, -1e10, 2147483647.0,
                               2147483648.0, -2147483648.0, -2147483649.0, 9.2233720368547758e18, -9.2233720368547758e18,
                               1e20, 3.4028234663852886e38, 1e39, -1e39, 1e-40, 1e-45, 5.9604644775390625e-08,
                               2.9802322387695312e-08, 1.0000000596046448, 1.00390625, 1.001953125, 1.0009765625,
                               1.00048828125, 3.14159265358979, inf, -inf, nan, -nan};
  const Tensor e = to_dtype(from_vector(edges, {int64_t(edges.size())}, DType::f64), src);
  const Tensor r = random_bits({4096}, src, seed);
  Tensor out = empty({e.numel() + r.numel()}, src);
  copy_(narrow(out, 0, 0, e.numel()), e);
  copy_(narrow(out, 0, e.numel(), r.numel()), r);
  return out;
}

TEST(CudaCopy, CastMatchesCpuBitExact) {
  SKIP_WITHOUT_CUDA();
  uint32_t seed = 100;
  for (DType from : kAllDTypes) {
    const Tensor src = cast_source(from, seed++);
    const Tensor gsrc = to_device(src, kGPU);
    for (DType to : kAllDTypes) {
      if (to == from) continue;
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
      EXPECT_TRUE(bits_equal(to_dtype(src, to), to_device(to_dtype(gsrc, to), kCPU), &src));
      // A strided source (every other element, reversed halves via a 2-D transpose).
      const int64_t n = src.numel() / 2 * 2;
      const Tensor s2 = transpose(view(narrow(src, 0, 0, n), {2, n / 2}), 0, 1);
      const Tensor g2 = transpose(view(narrow(gsrc, 0, 0, n), {2, n / 2}), 0, 1);
      EXPECT_TRUE(bits_equal(to_dtype(s2, to), to_device(to_dtype(g2, to), kCPU)));
    }
  }
}

TEST(CudaCopy, CopyIntoStridedDestinationWithBroadcast) {
  SKIP_WITHOUT_CUDA();
  for (DType to : kAllDTypes) {
    for (DType from : {DType::f32, DType::bf16, DType::i64}) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
      const Tensor src = cast_source(from, 7);
      const Tensor row = narrow(src, 0, 0, 5);  // broadcast over dim 0 of the destination
      Tensor cdst = zeros({4, 8, 5}, to), gdst = zeros({4, 8, 5}, to, kGPU);
      Tensor cview = transpose(narrow(cdst, 1, 2, 5), 0, 1);  // [5, 4, 5], strided
      Tensor gview = transpose(narrow(gdst, 1, 2, 5), 0, 1);
      copy_(cview, row);
      copy_(gview, to_device(row, kGPU));
      EXPECT_TRUE(bits_equal(cdst, to_device(gdst, kCPU)));
    }
  }
}

TEST(CudaCopy, FillAndArangeMatchCpu) {
  SKIP_WITHOUT_CUDA();
  for (DType dt : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dt));
    for (double v : {0.0, 1.0, -1.5, 3.3, 65504.0, 1e5, 257.0}) {
      if (!is_floating(dt) && v != std::trunc(v)) continue;
      if ((dt == DType::u8 || dt == DType::b8) && (v < 0 || v > 255)) continue;
      EXPECT_TRUE(bits_equal(full({3, 7}, v, dt), to_device(full({3, 7}, v, dt, kGPU), kCPU))) << "value " << v;
      // fill_ of a non-contiguous view leaves the rest alone.
      Tensor c = zeros({6, 9}, dt), g = zeros({6, 9}, dt, kGPU);
      fill_(narrow(transpose(c, 0, 1), 0, 2, 4), v);
      fill_(narrow(transpose(g, 0, 1), 0, 2, 4), v);
      EXPECT_TRUE(bits_equal(c, to_device(g, kCPU))) << "value " << v;
    }
    if (dt == DType::b8) continue;
    const double step = is_floating(dt) ? 0.1 : 3;
    const double end = dt == DType::u8 ? 250 : 1000;
    EXPECT_TRUE(bits_equal(arange(-2, end, step, dt), to_device(arange(-2, end, step, dt, kGPU), kCPU)));
  }
}

}  // namespace
}  // namespace blu
