// Targeted checks of the CUDA pointwise, reduction, random and join kernels against the CPU
// reference (the generic OpInfo cross-device test covers every op on small inputs; these cover
// what it does not: bit-identical random streams, large and odd sizes, broadcast, misaligned
// views, 16-bit rounding, long reductions, NaN and tie handling).
// Host-only tests (Div32, Philox, the randn rounding margin) run anywhere; the rest skip without
// a GPU. Run: ctest -L cuda, or build/tests/test_cuda --gtest_filter='CudaElementwise*'.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <sstream>

#include "blu/backend/backend.h"
#include "blu/backend/cuda/int_div.h"
#include "blu/backend/cuda/philox.cuh"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::kGPU;

Tensor gpu(const Tensor& t) { return to_device(contiguous(t), kGPU); }
Tensor cpu(const Tensor& t) {
  Tensor c = to_device(t, kCPU);
  return c.is_contiguous() ? c : contiguous(c);
}

// Raw bit patterns of a contiguous CPU tensor, one per element.
std::vector<uint64_t> bits_of(const Tensor& t) {
  const Tensor c = contiguous(t);
  const size_t sz = c.itemsize();
  std::vector<uint64_t> v(size_t(c.numel()), 0);
  const auto* p = static_cast<const unsigned char*>(c.raw_data());
  for (size_t i = 0; i < v.size(); ++i) std::memcpy(&v[i], p + i * sz, sz);
  return v;
}

// Bit-identical, with the first mismatches printed.
::testing::AssertionResult same_bits(const Tensor& expected_cpu, const Tensor& got_cuda) {
  const Tensor got = cpu(got_cuda);
  if (expected_cpu.shape() != got.shape() || expected_cpu.dtype() != got.dtype())
    return ::testing::AssertionFailure() << "meta: expected " << expected_cpu.str() << " got " << got.str();
  const auto a = bits_of(expected_cpu), b = bits_of(got);
  const auto va = to_vector(expected_cpu), vb = to_vector(got);
  int64_t bad = 0;
  std::ostringstream os;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    if (bad < 8)
      os << "\n  [" << i << "] cpu " << va[i] << " (0x" << std::hex << a[i] << ") cuda " << std::dec << vb[i] << " (0x"
         << std::hex << b[i] << std::dec << ")";
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " elements differ (" << got.str() << ")"
                                       << os.str();
}

// Distance in units in the last place of the tensor's own dtype (floating types; NaN == NaN).
int64_t ordered(uint64_t bits, DType dt) {
  const int nb = int(dtype_size(dt)) * 8;
  const uint64_t sign = uint64_t(1) << (nb - 1);
  const uint64_t mag = bits & (sign - 1);
  return (bits & sign) ? -int64_t(mag) : int64_t(mag);
}
// `atol`: differences this small pass whatever their ulp count (see the GELU checks).
::testing::AssertionResult within_ulps(const Tensor& expected_cpu, const Tensor& got_cuda, int64_t ulps,
                                       double atol = 0) {
  const Tensor got = cpu(got_cuda);
  if (expected_cpu.shape() != got.shape() || expected_cpu.dtype() != got.dtype())
    return ::testing::AssertionFailure() << "meta: expected " << expected_cpu.str() << " got " << got.str();
  const auto a = bits_of(expected_cpu), b = bits_of(got);
  const auto va = to_vector(expected_cpu), vb = to_vector(got);
  int64_t bad = 0, worst = 0, differ = 0;
  std::ostringstream os;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i] || (std::isnan(va[i]) && std::isnan(vb[i]))) continue;
    ++differ;
    const int64_t d = std::llabs(ordered(a[i], expected_cpu.dtype()) - ordered(b[i], expected_cpu.dtype()));
    worst = std::max(worst, d);
    if (d <= ulps || std::abs(va[i] - vb[i]) <= atol) continue;
    if (bad < 8) os << "\n  [" << i << "] cpu " << va[i] << " cuda " << vb[i] << " (" << d << " ulp)";
    ++bad;
  }
  if (bad == 0) {
    if (differ) std::cout << "  [info] " << differ << " of " << a.size() << " differ, worst " << worst << " ulp\n";
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " elements beyond " << ulps << " ulp" << os.str();
}

::testing::AssertionResult close_rel(const Tensor& expected_cpu, const Tensor& got_cuda, double rtol, double atol = 0) {
  const auto a = to_vector(expected_cpu), b = to_vector(cpu(got_cuda));
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "size " << a.size() << " vs " << b.size();
  int64_t bad = 0;
  double worst = 0;
  std::ostringstream os;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::fabs(a[i] - b[i]), tol = atol + rtol * std::fabs(a[i]);
    worst = std::max(worst, err / std::max(std::fabs(a[i]), 1e-30));
    if (err <= tol) continue;
    if (bad < 8) os << "\n  [" << i << "] cpu " << a[i] << " cuda " << b[i] << " rel " << err / std::fabs(a[i]);
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " beyond rtol " << rtol << " (worst rel "
                                       << worst << ")" << os.str();
}

const DType kFloats[] = {DType::f32, DType::f64, DType::bf16, DType::f16};

// ---------------------------------------------------------------- host-only
TEST(CudaElementwiseHost, Div32MatchesDivision) {
  std::mt19937_64 g(3);
  for (uint32_t d : {1u, 2u, 3u, 7u, 768u, 1031u, 50257u, 65536u, 65537u, (1u << 31) - 1}) {
    const cuda::Div32 v(d);
    for (uint32_t n = 0; n < 100000; ++n) ASSERT_EQ(v.div(n), n / d) << n << " / " << d;
    for (int k = 0; k < 100000; ++k) {
      const uint32_t n = uint32_t(g() >> 33);
      ASSERT_EQ(v.div(n), n / d) << n << " / " << d;
    }
  }
  for (int k = 0; k < 20000; ++k) {
    const uint32_t d = 1 + uint32_t(g() >> 33) % ((1u << 31) - 1), n = uint32_t(g() >> 33);
    ASSERT_EQ(cuda::Div32(d).div(n), n / d) << n << " / " << d;
    ASSERT_EQ(cuda::Div32(d).div((1u << 31) - 1), ((1u << 31) - 1) / d) << d;
  }
}

TEST(CudaElementwiseHost, PhiloxCopyMatchesCore) {
  for (uint64_t seed : {uint64_t(0), uint64_t(42), uint64_t(0x123456789abcdefull)})
    for (uint64_t ctr : {uint64_t(0), uint64_t(1), uint64_t(0xffffffffull), uint64_t(1) << 40}) {
      const auto a = Philox::block(seed, ctr);
      const auto b = cuda::philox_block(seed, ctr);
      for (int l = 0; l < 4; ++l) EXPECT_EQ(a[l], b.v[l]) << "seed " << seed << " counter " << ctr << " lane " << l;
    }
}

// The CUDA transform (philox.cuh, compiled here for the host) against the CPU kernel.
TEST(CudaElementwiseHost, NormalTransformMatchesCpuRandn) {
  Generator g(99, 5);
  const Tensor t = randn({4099}, DType::f32, kCPU, &g);
  const float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const auto r = cuda::philox_block(99, 5 + uint64_t(i / 4));
    ASSERT_EQ(std::bit_cast<uint32_t>(p[i]), std::bit_cast<uint32_t>(cuda::philox_normal(r, int(i % 4)))) << i;
  }
}

// randn rounds log, sin and cos from double to float. CUDA's double log/sin/cos are within 2 ulp
// (CUDA C Programming Guide, double-precision functions), glibc's within 1: the two agree after
// rounding whenever the double result lies more than 3 double ulps from a float rounding
// boundary. Check every input the transform can see (2^24 values each).
TEST(CudaElementwiseHost, RandnRoundingHasMarginOnEveryInput) {
  auto margin = [](double d) {  // distance to the nearest float midpoint, in double ulps
    const float f = float(d);
    const double lo = (double(f) + double(std::nextafter(f, -INFINITY))) / 2;
    const double hi = (double(f) + double(std::nextafter(f, INFINITY))) / 2;
    return std::fmin(std::fabs(d - lo), std::fabs(d - hi)) / (std::nextafter(d, INFINITY) - d);
  };
  double mlog = 1e300, msin = 1e300, mcos = 1e300;
  for (uint32_t j = 0; j < (1u << 24); ++j) {
    const float u = cuda::philox_uniform(j << 8, 24);
    const double l = std::log(double(1.0f - u));
    if (l != 0) mlog = std::fmin(mlog, margin(l));
    const float ang = 2.0f * std::numbers::pi_v<float> * u;
    const double s = std::sin(double(ang));
    if (s != 0) msin = std::fmin(msin, margin(s));
    mcos = std::fmin(mcos, margin(std::cos(double(ang))));
  }
  EXPECT_GT(mlog, 3.0);
  EXPECT_GT(msin, 3.0);
  EXPECT_GT(mcos, 3.0);
  std::cout << "  margins (double ulps): log " << mlog << " sin " << msin << " cos " << mcos << "\n";
}

// ---------------------------------------------------------------- random
TEST(CudaElementwise, RandomStreamsAreBitIdentical) {
  SKIP_WITHOUT_CUDA();
  for (DType dt : kFloats)
    for (int64_t n : {int64_t(1), int64_t(3), int64_t(4), int64_t(1001), int64_t((1 << 20) + 3)}) {
      Generator gc(1234, 17), gg(1234, 17);
      EXPECT_TRUE(same_bits(rand({n}, dt, kCPU, &gc), rand({n}, dt, kGPU, &gg))) << "rand " << dt << " n=" << n;
      EXPECT_TRUE(same_bits(randn({n}, dt, kCPU, &gc), randn({n}, dt, kGPU, &gg))) << "randn " << dt << " n=" << n;
      EXPECT_EQ(gc.offset(), gg.offset());
    }
  for (DType dt : {DType::i64, DType::i32, DType::f32, DType::bf16, DType::u8})
    for (auto [lo, hi] : std::vector<std::pair<int64_t, int64_t>>{{0, 50257}, {-7, 8}, {0, 2}}) {
      Generator gc(7), gg(7);
      EXPECT_TRUE(same_bits(randint(lo, hi, {100003}, dt, kCPU, &gc), randint(lo, hi, {100003}, dt, kGPU, &gg)))
          << "randint " << dt << " [" << lo << ", " << hi << ")";
    }
}

// ---------------------------------------------------------------- pointwise
TEST(CudaElementwise, LargeContiguousBinaryBitIdentical) {
  SKIP_WITHOUT_CUDA();
  Generator g(1);
  for (DType dt : kFloats)
    for (int64_t n : {int64_t(1000003), int64_t(7), int64_t(16)}) {
      const Tensor a = to_dtype(randn({n}, DType::f32, kCPU, &g), dt), b = to_dtype(randn({n}, DType::f32, kCPU, &g), dt);
      const Tensor ga = gpu(a), gb = gpu(b);
      EXPECT_TRUE(same_bits(add(a, b), add(ga, gb))) << "add " << dt << " n=" << n;
      EXPECT_TRUE(same_bits(sub(a, b), sub(ga, gb))) << "sub " << dt << " n=" << n;
      EXPECT_TRUE(same_bits(mul(a, b), mul(ga, gb))) << "mul " << dt << " n=" << n;
      EXPECT_TRUE(same_bits(div(a, b), div(ga, gb))) << "div " << dt << " n=" << n;
      EXPECT_TRUE(same_bits(mul(a, 0.3), mul(ga, 0.3))) << "mul_scalar " << dt;
      EXPECT_TRUE(same_bits(lt(a, b), lt(ga, gb))) << "lt " << dt;
      EXPECT_TRUE(same_bits(where(lt(a, b), a, b), where(lt(ga, gb), ga, gb))) << "where " << dt;
      // Misaligned: views starting one element in (no 16-byte alignment: the strided path).
      const Tensor na = narrow(a, 0, 1, n - 1), nb = narrow(b, 0, 0, n - 1);
      EXPECT_TRUE(same_bits(add(na, nb), add(narrow(ga, 0, 1, n - 1), narrow(gb, 0, 0, n - 1)))) << "narrow add " << dt;
      EXPECT_TRUE(same_bits(sqrt(abs(na)), sqrt(abs(narrow(ga, 0, 1, n - 1))))) << "sqrt " << dt;
    }
}

TEST(CudaElementwise, BroadcastAndStrided) {
  SKIP_WITHOUT_CUDA();
  Generator g(2);
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = to_dtype(randn({1001, 1031}, DType::f32, kCPU, &g), dt);
    const Tensor row = to_dtype(randn({1031}, DType::f32, kCPU, &g), dt);
    const Tensor col = to_dtype(randn({1001, 1}, DType::f32, kCPU, &g), dt);
    const Tensor gx = gpu(x), grow = gpu(row), gcol = gpu(col);
    EXPECT_TRUE(same_bits(add(x, row), add(gx, grow))) << "x + row " << dt;
    EXPECT_TRUE(same_bits(mul(col, row), mul(gcol, grow))) << "col * row (outer) " << dt;
    EXPECT_TRUE(same_bits(sub(transpose(x, 0, 1), unsqueeze(row, 1)),
                          sub(transpose(gx, 0, 1), unsqueeze(grow, 1))))
        << "transposed - col " << dt;
    EXPECT_TRUE(same_bits(gt(x, col), gt(gx, gcol))) << "gt broadcast " << dt;
    // 4-d permuted input against a broadcast 2-d one: several dims survive coalescing.
    const Tensor y = to_dtype(randn({3, 5, 7, 11}, DType::f32, kCPU, &g), dt), z = to_dtype(randn({7, 1}, DType::f32, kCPU, &g), dt);
    const Tensor py = permute(y, {2, 0, 3, 1});  // [7, 3, 11, 5]
    EXPECT_TRUE(same_bits(mul(py, unsqueeze(unsqueeze(z, 1), 1)),
                          mul(permute(gpu(y), {2, 0, 3, 1}), unsqueeze(unsqueeze(gpu(z), 1), 1))))
        << "permuted " << dt;
  }
  // Integer arithmetic and in-place add_ through a strided destination.
  const Tensor ia = randint(-1000, 1000, {513, 257}, DType::i32, kCPU, &g), ib = randint(1, 100, {257}, DType::i32, kCPU, &g);
  EXPECT_TRUE(same_bits(div(ia, ib), div(gpu(ia), gpu(ib))));
  EXPECT_TRUE(same_bits(mul(ia, ib), mul(gpu(ia), gpu(ib))));
  Tensor c = clone(ia), gc = gpu(ia);
  add_(transpose(c, 0, 1), transpose(ia, 0, 1));
  add_(transpose(gc, 0, 1), transpose(gpu(ia), 0, 1));
  EXPECT_TRUE(same_bits(c, gc)) << "add_ through a transposed view";
  // mul_ by a broadcast 0-d tensor (linear_cross_entropy's backward scaling), f32 and i32.
  const Tensor f = randn({513, 257}, DType::f32, kCPU, &g), s = full({}, 0.37, DType::f32);
  Tensor fc = clone(f), fg = gpu(f);
  mul_(fc, s);
  mul_(fg, gpu(s));
  EXPECT_TRUE(same_bits(fc, fg)) << "mul_ by a 0-d tensor";
  EXPECT_TRUE(same_bits(fc, mul(f, s))) << "mul_ equals mul";
  Tensor ic = clone(ia), ig = gpu(ia);
  mul_(transpose(ic, 0, 1), transpose(ia, 0, 1));
  mul_(transpose(ig, 0, 1), transpose(gpu(ia), 0, 1));
  EXPECT_TRUE(same_bits(ic, ig)) << "mul_ through a transposed view";
}

TEST(CudaElementwise, UnaryMathAgainstCpu) {
  SKIP_WITHOUT_CUDA();
  Generator g(3);
  // add/mul/neg/relu/abs/sign/clamp/sqrt/rsqrt/sigmoid* are IEEE-exact; exp/log/tanh/erf/pow come
  // from CUDA's math library (within 2 ulp in f32): bf16/f16 outputs agree within 1 ulp of their
  // own type, f32/f64 within a few float/double ulps.
  for (DType dt : kFloats) {
    const Tensor x = to_dtype(mul(randn({1000003}, DType::f32, kCPU, &g), 3.0), dt);
    const Tensor gx = gpu(x);
    EXPECT_TRUE(same_bits(neg(x), neg(gx))) << dt;
    EXPECT_TRUE(same_bits(relu(x), relu(gx))) << dt;
    EXPECT_TRUE(same_bits(abs(x), abs(gx))) << dt;
    EXPECT_TRUE(same_bits(sign(x), sign(gx))) << dt;
    EXPECT_TRUE(same_bits(clamp(x, -0.5, 0.75), clamp(gx, -0.5, 0.75))) << dt;
    EXPECT_TRUE(same_bits(add(x, 0.125), add(gx, 0.125))) << dt;
    EXPECT_TRUE(same_bits(rsqrt(abs(x)), rsqrt(abs(gx)))) << dt;
    const int64_t u16 = (dt == DType::bf16 || dt == DType::f16) ? 1 : 4;
    EXPECT_TRUE(within_ulps(exp(x), exp(gx), u16)) << "exp " << dt;
    EXPECT_TRUE(within_ulps(log(abs(x)), log(abs(gx)), u16)) << "log " << dt;
    EXPECT_TRUE(within_ulps(tanh(x), tanh(gx), u16)) << "tanh " << dt;
    EXPECT_TRUE(within_ulps(sigmoid(x), sigmoid(gx), u16)) << "sigmoid " << dt;
    // GELU's 1 + erf(·) and 1 + tanh(·) cancel in the negative tail, so there both devices carry
    // an absolute error of a few float ulps of 1 (~1e-7 in f32) and ulp counts of the tiny
    // result measure that cancellation, not the kernel: allow it as an absolute bound.
    // (16-bit types compute in fp32, so they inherit the fp32 bound before rounding.)
    const double gelu_atol = dt == DType::f64 ? 1e-15 : 4e-7;
    EXPECT_TRUE(within_ulps(gelu(x, true), gelu(gx, true), u16, gelu_atol)) << "gelu tanh " << dt;
    EXPECT_TRUE(within_ulps(gelu(x, false), gelu(gx, false), u16, gelu_atol)) << "gelu erf " << dt;
    EXPECT_TRUE(within_ulps(pow(abs(x), 1.7), pow(abs(gx), 1.7), u16 + 4)) << "pow_scalar " << dt;
  }
}

TEST(CudaElementwise, SixteenBitRoundingAndNaN) {
  SKIP_WITHOUT_CUDA();
  // Products and sums that land exactly between two bf16/f16 values (ties to even), overflow,
  // subnormal results and NaN (encoded as the CPU encodes it).
  for (DType dt : {DType::bf16, DType::f16}) {
    std::vector<double> a, b;
    for (int i = -300; i <= 300; ++i) {
      a.push_back(1.0 + i / 128.0);
      b.push_back(1.0 + 1.0 / 256.0 * (i % 7));
    }
    a.insert(a.end(), {65504.0, 1e-6, -1e-7, 3e38, NAN, -0.0});
    b.insert(b.end(), {2.0, 1e-3, 3e-2, 10.0, 1.0, 0.0});
    const Tensor ta = from_vector(a, {int64_t(a.size())}, dt), tb = from_vector(b, {int64_t(b.size())}, dt);
    EXPECT_TRUE(same_bits(mul(ta, tb), mul(gpu(ta), gpu(tb)))) << dt;
    EXPECT_TRUE(same_bits(add(ta, tb), add(gpu(ta), gpu(tb)))) << dt;
    EXPECT_TRUE(same_bits(mul(ta, 1.0 / 3.0), mul(gpu(ta), 1.0 / 3.0))) << dt;
  }
}

TEST(CudaElementwise, GradHelpers) {
  SKIP_WITHOUT_CUDA();
  Generator g(4);
  for (DType dt : kFloats) {
    const Tensor x = to_dtype(mul(randn({300007}, DType::f32, kCPU, &g), 3.0), dt);
    const Tensor gr = to_dtype(randn({300007}, DType::f32, kCPU, &g), dt);
    for (bool approx : {true, false}) {
      Tensor xc = clone(x).set_requires_grad(), xg = gpu(x).set_requires_grad();
      gelu(xc, approx).backward(gr);
      gelu(xg, approx).backward(gpu(gr));
      const int64_t u = (dt == DType::bf16 || dt == DType::f16) ? 1 : 8;
      // As for the forward (above): cancellation in the tail, bounded absolutely (|grad| ~ 3).
      const double atol = dt == DType::f64 ? 4e-15 : 1.2e-6;
      EXPECT_TRUE(within_ulps(xc.grad(), xg.grad(), u, atol)) << "gelu_backward " << dt << " approx=" << approx;
    }
    Tensor xc = clone(x).set_requires_grad(), xg = gpu(x).set_requires_grad();
    clamp(xc, -1.0, 2.0).backward(gr);
    clamp(xg, -1.0, 2.0).backward(gpu(gr));
    EXPECT_TRUE(same_bits(xc.grad(), xg.grad())) << "clamp_backward " << dt;
  }
}

// gelu_and_backward with a third output (the compiler's bias-gradient fold, compiler/epilogue.h):
// the GELU, its gradient and the gradient's column sum in one pass, each bit for bit what
// gelu_and_backward and the weight-gradient op's own bias gradient (linear_weight_grad[_into])
// give, in the gradient's dtype and in f32.
TEST(CudaElementwise, GeluAndBackwardSumsTheBiasGradientBitwise) {
  SKIP_WITHOUT_CUDA();
  Generator g(6);
  const Kernel fused = backend(DeviceType::cuda).find("gelu_and_backward");
  ASSERT_NE(fused, nullptr);
  for (DType dt : {DType::bf16, DType::f16, DType::f32})
    for (auto [R, N] : {std::pair<int64_t, int64_t>{16384, 768}, {777, 3072}, {5, 40}}) {
      SCOPED_TRACE(testing::Message() << dt << " [" << R << ", " << N << "]");
      const Tensor x = gpu(to_dtype(mul(randn({R, N}, DType::f32, kCPU, &g), 2.0), dt));
      const Tensor gr = gpu(to_dtype(randn({R, N}, DType::f32, kCPU, &g), dt));
      const Tensor xin = gpu(to_dtype(randn({R, 24}, DType::f32, kCPU, &g), dt));
      const std::vector<Tensor> ref = gelu_and_backward(gr, x, true);
      const std::vector<Tensor> wb = linear_weight_grad(ref[1], xin);
      const Tensor gw32 = empty({N, 24}, DType::f32, kGPU), gb32 = empty({N}, DType::f32, kGPU);
      linear_weight_grad_into(gw32, ref[1], xin, gb32);
      for (DType bias_dt : {dt, DType::f32}) {
        std::array<Tensor, 2> in{gr, x};
        std::array<Tensor, 3> out{empty({R, N}, dt, kGPU), empty({R, N}, dt, kGPU), empty({N}, bias_dt, kGPU)};
        Attrs a;
        a.set("approximate", true);
        fused(KernelCall{"gelu_and_backward", in, out, a, current_context(kGPU)});
        EXPECT_TRUE(same_bits(cpu(ref[0]), out[0])) << "gelu";
        EXPECT_TRUE(same_bits(cpu(ref[1]), out[1])) << "gradient";
        EXPECT_TRUE(same_bits(cpu(bias_dt == dt ? wb[1] : gb32), out[2])) << "bias gradient in " << bias_dt;
      }
    }
}

// ---------------------------------------------------------------- reductions
TEST(CudaElementwise, SumLargeDims) {
  SKIP_WITHOUT_CUDA();
  Generator g(5);
  const Tensor x = randn({4097, 1031}, DType::f32, kCPU, &g), gx = gpu(x);
  // f32 accumulates in float on the GPU, double on the CPU.
  EXPECT_TRUE(close_rel(sum(x, {1}), sum(gx, {1}), 1e-5, 1e-4)) << "rows";
  EXPECT_TRUE(close_rel(sum(x, {0}), sum(gx, {0}), 1e-5, 1e-4)) << "cols";
  EXPECT_TRUE(close_rel(sum(x), sum(gx), 1e-5, 1e-3)) << "all (split)";
  EXPECT_TRUE(close_rel(sum(x, {0}, true), sum(gx, {0}, true), 1e-5, 1e-4)) << "keepdim";
  EXPECT_TRUE(close_rel(sum(transpose(x, 0, 1), {1}), sum(transpose(gx, 0, 1), {1}), 1e-5, 1e-4)) << "transposed";
  const Tensor big = rand({(1 << 24) + 5}, DType::f32, kCPU, &g);
  EXPECT_TRUE(close_rel(sum(big), sum(gpu(big)), 1e-5)) << "2^24 + 5 elements";
  const Tensor y = randn({3, 5000, 7}, DType::f32, kCPU, &g);
  EXPECT_TRUE(close_rel(sum(y, {0, 2}), sum(gpu(y), {0, 2}), 1e-5, 1e-4)) << "dims (0, 2)";
  EXPECT_TRUE(close_rel(sum(y, {1}), sum(gpu(y), {1}), 1e-5, 1e-4)) << "middle dim";
  // Many outputs over a few rows (a position embedding's gradient): a thread per 16 bytes of outputs.
  const Tensor z = randn({16, 64, 1024}, DType::f32, kCPU, &g), gz = gpu(z);
  EXPECT_TRUE(close_rel(sum(z, {0}), sum(gz, {0}), 1e-5, 1e-4)) << "leading rows f32";
  EXPECT_TRUE(close_rel(sum(z, {0, 1}), sum(gz, {0, 1}), 1e-5, 1e-4)) << "leading rows, few outputs";
  const Tensor zb = to_dtype(z, DType::bf16);
  EXPECT_TRUE(close_rel(sum(zb, {0}), sum(gpu(zb), {0}), 1e-2, 1e-1))
      << "leading rows bf16";
  EXPECT_TRUE(same_bits(cpu(sum(gz, {0})), sum(gz, {0})));
  // Deterministic: the same sum twice gives the same bits.
  EXPECT_TRUE(same_bits(cpu(sum(gx, {0})), sum(gx, {0})));
  EXPECT_TRUE(same_bits(cpu(sum(gx)), sum(gx)));
  // Other dtypes: f64 tight, bf16 loose (float accumulation, one rounding), integers exact.
  const Tensor xd = to_dtype(x, DType::f64);
  EXPECT_TRUE(close_rel(sum(xd, {0}), sum(gpu(xd), {0}), 1e-12, 1e-12));
  const Tensor xb = to_dtype(x, DType::bf16);
  EXPECT_TRUE(close_rel(sum(xb, {1}), sum(gpu(xb), {1}), 1e-2, 1e-1));
  const Tensor xi = randint(-100, 100, {4097, 1031}, DType::i32, kCPU, &g);
  EXPECT_TRUE(same_bits(sum(xi, {0}), sum(gpu(xi), {0})));
  EXPECT_TRUE(same_bits(sum(xi), sum(gpu(xi))));
  const Tensor e = zeros({0, 5});
  EXPECT_TRUE(same_bits(sum(e, {0}), sum(to_device(e, kGPU), {0}))) << "empty reduced dim";
}

TEST(CudaElementwise, MaxMinNaNAndTies) {
  SKIP_WITHOUT_CUDA();
  Generator g(6);
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    // Few distinct values: many ties; rows long enough to use many threads.
    Tensor x = to_dtype(randint(0, 5, {67, 2053}, DType::i64, kCPU, &g), dt);
    if (dt != DType::i64) {
      std::vector<double> v = to_vector(x);
      v[3 * 2053 + 100] = NAN;
      v[3 * 2053 + 7] = NAN;
      v[10 * 2053 + 2000] = NAN;
      x = from_vector(v, {67, 2053}, dt);
    }
    const Tensor gx = gpu(x);
    for (int64_t d : {0, 1}) {
      auto [cv, ci] = max(x, d);
      auto [gv, gi] = max(gx, d);
      EXPECT_TRUE(same_bits(cv, gv)) << "max values dim " << d << " " << dt;
      EXPECT_TRUE(same_bits(ci, gi)) << "max indices dim " << d << " " << dt;
      auto [cv2, ci2] = min(x, d, true);
      auto [gv2, gi2] = min(gx, d, true);
      EXPECT_TRUE(same_bits(cv2, gv2)) << "min values dim " << d << " " << dt;
      EXPECT_TRUE(same_bits(ci2, gi2)) << "min indices dim " << d << " " << dt;
    }
    EXPECT_TRUE(same_bits(max(x), max(gx))) << "max over all " << dt;
  }
}

TEST(CudaElementwise, MaxBackwardScatters) {
  SKIP_WITHOUT_CUDA();
  Generator g(7);
  const Tensor x = randn({129, 257}, DType::f32, kCPU, &g);
  const Tensor gr = randn({257}, DType::f32, kCPU, &g);
  Tensor xc = clone(x).set_requires_grad(), xg = gpu(x).set_requires_grad();
  max(xc, 0).first.backward(gr);
  max(xg, 0).first.backward(gpu(gr));
  EXPECT_TRUE(same_bits(xc.grad(), xg.grad()));
}

// ---------------------------------------------------------------- join
TEST(CudaElementwise, CatManyInputs) {
  SKIP_WITHOUT_CUDA();
  Generator g(8);
  for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::b8}) {
    const Tensor a = to_dtype(randn({37, 129}, DType::f32, kCPU, &g), dt);
    const Tensor b = to_dtype(randn({129, 5}, DType::f32, kCPU, &g), dt);  // used transposed
    const Tensor c = to_dtype(randn({1, 129}, DType::f32, kCPU, &g), dt);
    const Tensor ga = gpu(a), gb = gpu(b), gc = gpu(c);
    EXPECT_TRUE(same_bits(cat({a, transpose(b, 0, 1), c}, 0), cat({ga, transpose(gb, 0, 1), gc}, 0))) << "dim 0 " << dt;
    EXPECT_TRUE(same_bits(cat({transpose(a, 0, 1), b, transpose(c, 0, 1), b}, 1),
                          cat({transpose(ga, 0, 1), gb, transpose(gc, 0, 1), gb}, 1)))
        << "dim 1 " << dt;
  }
  const Tensor big = randn({1000003}, DType::f32, kCPU, &g);
  EXPECT_TRUE(same_bits(cat({big, narrow(big, 0, 3, 1000)}), cat({gpu(big), narrow(gpu(big), 0, 3, 1000)})));
}

// Strided operands whose rows are contiguous take the 16-byte row path (loops.cuh): cat along the
// last dim (split's backward in attention), a permute of outer dims, a broadcast row; rows that
// are not whole vectors or not aligned fall back to the element path. All bit-exact vs the CPU.
TEST(CudaElementwise, RowContiguousStridedCopies) {
  SKIP_WITHOUT_CUDA();
  Generator g(9);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    auto r = [&](const Shape& s) { return to_dtype(randn(s, DType::f32, kCPU, &g), dt); };
    const Tensor q = r({4, 33, 96}), k = r({4, 33, 96}), v = r({4, 33, 96});
    EXPECT_TRUE(same_bits(cat({q, k, v}, 2), cat({gpu(q), gpu(k), gpu(v)}, 2))) << "cat last dim " << dt;
    const Tensor h = r({3, 17, 5, 64});  // [B, T, H, D] -> [B, H, T, D] and back
    EXPECT_TRUE(same_bits(contiguous(permute(h, {0, 2, 1, 3})), contiguous(permute(gpu(h), {0, 2, 1, 3}))))
        << "permute outer dims " << dt;
    const Tensor row = r({64});
    EXPECT_TRUE(same_bits(add(permute(h, {0, 2, 1, 3}), row), add(permute(gpu(h), {0, 2, 1, 3}), gpu(row))))
        << "strided + broadcast row " << dt;
    const Tensor odd = r({7, 45});  // 45-element rows: not whole vectors
    EXPECT_TRUE(same_bits(cat({odd, odd}, 1), cat({gpu(odd), gpu(odd)}, 1))) << "odd rows " << dt;
    const Tensor wide = r({9, 40});  // rows start 1 element in: misaligned
    EXPECT_TRUE(same_bits(contiguous(narrow(wide, 1, 1, 32)), contiguous(narrow(gpu(wide), 1, 1, 32))))
        << "misaligned rows " << dt;
    EXPECT_TRUE(same_bits(contiguous(narrow(wide, 1, 8, 32)), contiguous(narrow(gpu(wide), 1, 8, 32))))
        << "aligned slice of rows " << dt;
  }
}

}  // namespace
}  // namespace blu
