// The many-tensor adamw_step op: one call over a list equals one call per tensor bit for bit (odd
// sizes, non-contiguous and offset views, different weight decays), its compute copies equal
// to_dtype of the updated parameters, it refuses bad lists, and it bumps the versions of exactly
// the storages it writes (Note [Storage versions]).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "blu/blu.h"
#include "blu/ops/optim.h"
#include "common/opinfo.h"
#include "common/checks.h"

namespace blu::test {
namespace {

// One parameter's tensors, built so that two sets can start from the same values.
struct Slot {
  Tensor p, m, v, c;  // c: compute copy (undefined when dtype is f32)
};
// Odd shapes; index 3 non-contiguous (transposed), index 4 a view at an odd offset of a larger
// buffer (not 16-byte aligned), index 5 empty.
std::vector<Slot> make_slots(uint64_t seed, DType copy_dtype) {
  Generator gen(seed);
  const std::vector<Shape> shapes = {{7, 5}, {13}, {3, 1, 4}, {5, 3}, {37}, {0, 4}, {1}};
  std::vector<Slot> out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    Slot s;
    s.p = rnd(gen, shapes[i], DType::f32);
    if (i == 3) s.p = noncontig(s.p);
    if (i == 4) {
      Tensor big = rnd(gen, {41}, DType::f32);
      s.p = narrow(big, 0, 3, 37);
    }
    s.m = mul(rnd(gen, shapes[i], DType::f32), 0.1);
    s.v = abs(mul(rnd(gen, shapes[i], DType::f32), 0.01));
    if (i == 2) s.m = noncontig(s.m);  // a strided moment too
    if (copy_dtype != DType::f32) s.c = zeros(shapes[i], copy_dtype);
    out.push_back(s);
  }
  return out;
}
std::vector<Slot> clone_slots(const std::vector<Slot>& a) {
  std::vector<Slot> out;
  for (const Slot& s : a) {
    Slot c{clone(s.p), clone(s.m), clone(s.v), s.c.defined() ? clone(s.c) : Tensor()};
    if (!s.p.is_contiguous()) c.p = noncontig(c.p);
    out.push_back(c);
  }
  return out;
}

TEST(AdamWMulti, ListEqualsOneTensorAtATimeBitwise) {
  NoGradGuard ng;
  for (DType copy_dtype : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(copy_dtype));
    std::vector<Slot> a = make_slots(5, copy_dtype), b = clone_slots(a);
    Generator gen(9);
    const double wd[2] = {0.1, 0.0};  // even tensors decay, odd ones do not
    for (int64_t step = 1; step <= 4; ++step) {
      std::vector<Tensor> g;
      for (const Slot& s : a) g.push_back(rnd(gen, s.p.shape(), DType::f32));
      g[1] = noncontig(g[1]);  // a strided gradient (1-D: every other element)
      for (int k = 0; k < 2; ++k) {
        const AdamWStepArgs args{.lr = 1e-2 * double(step), .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                                 .weight_decay = wd[k], .step = step};
        std::vector<AdamWTensors> list;
        for (size_t i = size_t(k); i < a.size(); i += 2) {
          list.push_back({a[i].p, g[i], a[i].m, a[i].v, a[i].c});
          adamw_step_({{b[i].p, g[i], b[i].m, b[i].v, b[i].c}}, args);
        }
        adamw_step_(list, args);
      }
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(a[i].p, b[i].p)) << "param " << i << " step " << step;
        EXPECT_TRUE(bitwise_equal(a[i].m, b[i].m)) << "exp_avg " << i << " step " << step;
        EXPECT_TRUE(bitwise_equal(a[i].v, b[i].v)) << "exp_avg_sq " << i << " step " << step;
        if (copy_dtype != DType::f32) {
          EXPECT_TRUE(bitwise_equal(a[i].c, to_dtype(a[i].p, copy_dtype))) << "copy " << i << " step " << step;
        }
      }
    }
  }
}

// One element against the documented formula, written out in fp32 with the same roundings.
TEST(AdamWMulti, OneElementFollowsTheFormula) {
  NoGradGuard ng;
  Tensor p = full({1}, 0.5), g = full({1}, 0.25), m = full({1}, 0.1), v = full({1}, 0.02);
  Tensor c = zeros({1}, DType::bf16);
  const AdamWStepArgs a{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 3};
  adamw_step_({{p, g, m, v, c}}, a);
  const double bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.95, 3);
  float pe = 0.5f * float(1 - 1e-2 * 0.1);
  const float me = 0.1f * 0.9f + float(1 - 0.9) * 0.25f;
  const float ve = 0.02f * 0.95f + float(1 - 0.95) * 0.25f * 0.25f;
  pe = pe + float(-(1e-2 / bc1)) * me / (std::sqrt(ve) / float(std::sqrt(bc2)) + float(1e-8));
  EXPECT_EQ(float(p.item()), pe);
  EXPECT_EQ(float(m.item()), me);
  EXPECT_EQ(float(v.item()), ve);
  EXPECT_EQ(float(c.item()), float(bf16(pe)));
}

TEST(AdamWMulti, RefusesBadLists) {
  NoGradGuard ng;
  auto t = [](Shape s, DType d = DType::f32) { return zeros(s, d); };
  const AdamWStepArgs a{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = 1};
  EXPECT_NE(error_of([&] {
              adamw_step_({{t({3}), t({3}), t({3}), t({3}), t({3}, DType::bf16)}, {t({2}), t({2}), t({2}), t({2})}},
                          a);
            }).find("either all have one or none"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              adamw_step_({{t({3}), t({3}), t({3}), t({3}), t({3}, DType::bf16)},
                           {t({2}), t({2}), t({2}), t({2}), t({2}, DType::f16)}},
                          a);
            }).find("share one dtype"),
            std::string::npos);
  EXPECT_NE(error_of([&] { adamw_step_({{t({3}), t({3}), t({3}), t({3}), t({3}, DType::f32)}}, a); })
                .find("compute copy of tensor 0 must be bf16 or f16"),
            std::string::npos);
  EXPECT_NE(error_of([&] { adamw_step_({{t({3}), t({3}), t({4}), t({3})}}, a); }).find("exp_avg shape [4]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { adamw_step_({{t({3}), t({3}, DType::bf16), t({3}), t({3})}}, a); })
                .find("grad of tensor 0 must be f32"),
            std::string::npos);
  AdamWStepArgs bad = a;
  bad.step = 0;
  EXPECT_NE(error_of([&] { adamw_step_({{t({3}), t({3}), t({3}), t({3})}}, bad); }).find("step must be >= 1"),
            std::string::npos);
  adamw_step_({}, a);  // nothing to do
}

TEST(StorageVersion, InplaceOpsBumpWhatTheyWrite) {
  NoGradGuard ng;
  Tensor x = zeros({4});  // (made by an in-place fill_: counts are compared as differences)
  auto bumps = [](const Tensor& t, uint64_t since) { return t.storage()->version() - since; };
  const uint64_t x0 = x.storage()->version();
  const Tensor y = add(x, x);
  EXPECT_EQ(bumps(x, x0), 0u);  // read, not written
  EXPECT_EQ(y.storage()->version(), 0u);  // an op's fresh output
  fill_(x, 1.0);
  EXPECT_EQ(bumps(x, x0), 1u);
  copy_(narrow(x, 0, 1, 2), full({2}, 3.0));  // through a view: the shared storage
  EXPECT_EQ(bumps(x, x0), 2u);
  add_(x, y);
  mul_(x, 2.0);
  EXPECT_EQ(bumps(x, x0), 4u);
  EXPECT_EQ(y.storage()->version(), 0u);

  Tensor p = zeros({3}), g = ones({3}), m = zeros({3}), v = zeros({3}), c = zeros({3}, DType::bf16);
  std::vector<uint64_t> before;
  for (const Tensor& t : {p, g, m, v, c}) before.push_back(t.storage()->version());
  adamw_step_({{p, g, m, v, c}},
              {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = 1});
  EXPECT_EQ(bumps(p, before[0]), 1u);
  EXPECT_EQ(bumps(g, before[1]), 0u);  // the gradient is only read
  EXPECT_EQ(bumps(m, before[2]), 1u);
  EXPECT_EQ(bumps(v, before[3]), 1u);
  EXPECT_EQ(bumps(c, before[4]), 1u);
  Tensor buf = zeros({3});
  const uint64_t b0 = buf.storage()->version();
  sgd_step_(p, g, buf, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0, .nesterov = false, .init_buffer = true});
  EXPECT_EQ(bumps(p, before[0]), 2u);
  EXPECT_EQ(bumps(buf, b0), 1u);
  EXPECT_EQ(bumps(g, before[1]), 0u);
}

}  // namespace
}  // namespace blu::test
