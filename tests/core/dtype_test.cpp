// core/dtype: the 16-bit float conversions against PyTorch bit for bit, type promotion, names.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "blu/blu.h"
#include "common/torch_oracle.h"

namespace blu {
namespace {

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// ~100k float32 values aimed at the hard cases of rounding to bf16 and f16.
std::vector<float> conversion_cases() {
  std::vector<float> v;
  std::mt19937 rng(20240520);
  auto add_signed = [&](float f) {
    v.push_back(f);
    v.push_back(-f);
  };
  auto around = [&](uint32_t u) {  // u and its float neighbours
    for (int d = -2; d <= 2; ++d) add_signed(from_bits(u + uint32_t(d)));
  };
  // Any bit pattern (normals of every exponent, some NaN/inf/subnormals).
  for (int i = 0; i < 30000; ++i) v.push_back(from_bits(rng()));
  // bf16 ties: exactly halfway between two bf16 values (low half 0x8000), and one ulp either side.
  for (int i = 0; i < 8000; ++i) {
    const uint32_t hi = rng() & 0x7fff0000u;
    if ((hi >> 23) == 0xff) continue;
    around(hi | 0x8000u);
  }
  // bf16 subnormals (float subnormals) and their ties.
  for (uint32_t h = 1; h < 0x80; ++h) around(h << 16 | 0x8000u);
  for (int i = 0; i < 3000; ++i) add_signed(from_bits(rng() & 0x007fffffu));
  // f16 ties: the midpoint of every pair of neighbouring f16 values (exact in float32), normal and
  // subnormal, with their float neighbours.
  for (uint32_t h = 0; h < 0x7bff; h += 3) {
    const float lo = f16::to_float(uint16_t(h)), hi = f16::to_float(uint16_t(h + 1));
    around(bits_of(0.5f * (lo + hi)));
  }
  // f16 subnormal range [2^-25, 2^-14) and below it.
  for (int i = 0; i < 5000; ++i) add_signed(std::ldexp(float(rng()) / 4294967296.0f, -14 - int(rng() % 12)));
  for (float f : {0x1p-25f, 0x1p-24f, 0x3p-25f, 0x1p-14f, 0x1p-26f}) around(bits_of(f));
  // Overflow boundaries: f16 max 65504, the tie 65520 (→ inf), bf16 max, float max, the bf16 tie
  // that rounds up to inf.
  for (float f : {65504.0f, 65519.0f, 65520.0f, 65536.0f, 65535.0f}) around(bits_of(f));
  around(0x7f7f0000u);  // bf16 max
  around(0x7f7f8000u);  // halfway from bf16 max to inf
  around(0x7f7ffffdu);  // float max (+2 would be inf/NaN patterns, also fine)
  // Specials.
  for (uint32_t u : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u,
                     0x7fffffffu, 0xffbfffffu, 0x00000001u, 0x80000001u, 0x3f800000u})
    v.push_back(from_bits(u));
  return v;
}

bool same_bits_or_both_nan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b);
}
bool same_16_or_both_nan(uint16_t a, uint16_t b, bool is_bf16) {
  auto nan = [&](uint16_t h) { return is_bf16 ? std::isnan(float(bf16::from_bits(h))) : std::isnan(f16::to_float(h)); };
  return a == b || (nan(a) && nan(b));
}

TEST(DType, SixteenBitConversionsMatchPyTorchBitForBit) {
  const std::vector<float> xs = conversion_cases();
  ASSERT_GT(xs.size(), 90000u);
  const int64_t n = int64_t(xs.size());
  Tensor x = empty({n}, DType::f32);
  std::copy(xs.begin(), xs.end(), x.data<float>());
  Tensor all_bf16 = empty({65536}, DType::bf16), all_f16 = empty({65536}, DType::f16);
  for (uint32_t h = 0; h < 65536; ++h) {
    all_bf16.data<bf16>()[h] = bf16::from_bits(uint16_t(h));
    all_f16.data<f16>()[h] = f16::from_bits(uint16_t(h));
  }
  test::TorchOracle oracle;
  oracle.put("x", x);
  oracle.put("all_bf16", all_bf16);
  oracle.put("all_f16", all_f16);
  auto r = oracle.run("core/torch_casts.py", nlohmann::json::object());
  const Tensor want_bf = r.get("bf16"), want_hf = r.get("f16");
  const Tensor want_bf_f = r.get("bf16_f32"), want_hf_f = r.get("f16_f32");
  ASSERT_EQ(want_bf.numel(), n);
  // The scalar conversions and the cast kernel (to_dtype) must both agree with PyTorch.
  const Tensor got_bf = to_dtype(x, DType::bf16), got_hf = to_dtype(x, DType::f16);
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 10; ++i) {
    const float f = xs[size_t(i)];
    const uint16_t wb = want_bf.data<bf16>()[i].bits, wh = want_hf.data<f16>()[i].bits;
    const bool ok = same_16_or_both_nan(bf16(f).bits, wb, true) && same_16_or_both_nan(f16(f).bits, wh, false) &&
                    same_16_or_both_nan(got_bf.data<bf16>()[i].bits, wb, true) &&
                    same_16_or_both_nan(got_hf.data<f16>()[i].bits, wh, false) &&
                    same_bits_or_both_nan(float(bf16(f)), want_bf_f.data<float>()[i]) &&
                    same_bits_or_both_nan(float(f16(f)), want_hf_f.data<float>()[i]);
    if (!ok) {
      ++bad;
      ADD_FAILURE() << std::hex << "x=0x" << bits_of(f) << " (" << f << "): bf16 ours 0x" << bf16(f).bits
                    << " torch 0x" << wb << "; f16 ours 0x" << f16(f).bits << " torch 0x" << wh;
    }
  }
  // Widening every 16-bit pattern.
  const Tensor all_bf_f = r.get("all_bf16_f32"), all_hf_f = r.get("all_f16_f32");
  for (uint32_t h = 0; h < 65536 && bad < 20; ++h) {
    const float b = float(bf16::from_bits(uint16_t(h))), hf = f16::to_float(uint16_t(h));
    if (!same_bits_or_both_nan(b, all_bf_f.data<float>()[h]) || !same_bits_or_both_nan(hf, all_hf_f.data<float>()[h])) {
      ++bad;
      ADD_FAILURE() << std::hex << "pattern 0x" << h << ": bf16→f32 0x" << bits_of(b) << " vs 0x"
                    << bits_of(all_bf_f.data<float>()[h]) << ", f16→f32 0x" << bits_of(hf) << " vs 0x"
                    << bits_of(all_hf_f.data<float>()[h]);
    }
  }
}

TEST(DType, KnownRoundings) {
  EXPECT_EQ(f16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(f16(65520.0f).bits, 0x7c00);                 // tie → even → inf
  EXPECT_EQ(f16(std::nextafter(65520.0f, 0.0f)).bits, 0x7bff);
  EXPECT_EQ(f16(0x1p-24f).bits, 0x0001);                 // smallest subnormal
  EXPECT_EQ(f16(0x1p-25f).bits, 0x0000);                 // tie → even → 0
  EXPECT_EQ(f16(0x3p-25f).bits, 0x0002);                 // 1.5 ulp: tie → even → 2
  EXPECT_EQ(f16(-0.0f).bits, 0x8000);
  EXPECT_EQ(bf16(-0.0f).bits, 0x8000);
  EXPECT_EQ(bf16(from_bits(0x3f808000u)).bits, 0x3f80);  // tie, even stays
  EXPECT_EQ(bf16(from_bits(0x3f818000u)).bits, 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(bf16(from_bits(0x7f7f8000u)).bits, 0x7f80);  // past bf16 max → inf
  EXPECT_TRUE(std::isnan(float(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(float(f16(-std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float(f16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
}

TEST(DType, PromoteAsPyTorch) {
  using D = DType;
  // torch.promote_types for the pairs we support.
  EXPECT_EQ(promote(D::f32, D::f32), D::f32);
  EXPECT_EQ(promote(D::bf16, D::f16), D::f32);
  EXPECT_EQ(promote(D::f16, D::bf16), D::f32);
  EXPECT_EQ(promote(D::bf16, D::f32), D::f32);
  EXPECT_EQ(promote(D::f16, D::f64), D::f64);
  EXPECT_EQ(promote(D::f32, D::f64), D::f64);
  EXPECT_EQ(promote(D::i64, D::f16), D::f16);
  EXPECT_EQ(promote(D::bf16, D::i32), D::bf16);
  EXPECT_EQ(promote(D::b8, D::f32), D::f32);
  EXPECT_EQ(promote(D::i32, D::i64), D::i64);
  EXPECT_EQ(promote(D::u8, D::i32), D::i32);
  EXPECT_EQ(promote(D::b8, D::u8), D::u8);
  EXPECT_EQ(promote(D::b8, D::i64), D::i64);
  EXPECT_EQ(promote(D::b8, D::b8), D::b8);
  for (int a = 0; a < kNumDTypes; ++a)
    for (int b = 0; b < kNumDTypes; ++b) EXPECT_EQ(promote(D(a), D(b)), promote(D(b), D(a)));
}

TEST(DType, NamesAndSizes) {
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType t = DType(i);
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  }
  EXPECT_EQ(dtype_from_name("bfloat16"), DType::bf16);
  EXPECT_EQ(dtype_from_name("half"), DType::f16);
  EXPECT_EQ(dtype_from_name("F64"), DType::f64);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_size(DType::b8), 1u);
  try {
    dtype_from_name("float8");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'float8'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("expected one of"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dtype_from_name(""), Error);
}

}  // namespace
}  // namespace blu
