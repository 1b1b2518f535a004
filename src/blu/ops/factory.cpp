#include "blu/ops/factory.h"

#include <cmath>

#include "blu/ops/dispatch.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

std::vector<TensorMeta> infer_from_attrs(std::span<const Tensor>, const Attrs& a) {
  const Shape& shape = a.get<Shape>("shape");
  for (int64_t d : shape) BLU_CHECK(d >= 0, "negative size in shape ", shape);
  const int64_t dev = a.i("device");
  return {TensorMeta{shape, a.get<DType>("dtype"), Device(DeviceType(dev >> 16), int(dev & 0xffff))}};
}
int64_t pack_device(Device d) { return int64_t(d.type) << 16 | d.index; }

std::vector<TensorMeta> infer_fill(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}

const OpDef kEmpty{.name = "empty", .infer = infer_from_attrs};
const OpDef kFill{.name = "fill_", .infer = infer_fill, .inplace = true};
const OpDef kArange{.name = "arange", .infer = infer_from_attrs};
const OpDef kRand{.name = "rand", .infer = infer_from_attrs};
const OpDef kRandn{.name = "randn", .infer = infer_from_attrs};
const OpDef kRandint{.name = "randint", .infer = infer_from_attrs};

Attrs shape_attrs(const Shape& shape, DType dtype, Device device) {
  return Attrs{{"shape", shape}, {"dtype", dtype}, {"device", pack_device(device)}};
}

}  // namespace

Tensor empty(const Shape& shape, DType dtype, Device device) {
  return dispatch1(kEmpty, {}, shape_attrs(shape, dtype, device));
}
const Tensor& fill_(const Tensor& t, double value) {
  dispatch(kFill, {t}, Attrs{{"value", value}});
  return t;
}
Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  return fill_(t, value);
}
Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device()); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }

Tensor arange(double start, double end, double step, DType dtype, Device device) {
  BLU_CHECK(step != 0, "arange: step must be non-zero");
  BLU_CHECK(std::isfinite(start) && std::isfinite(end), "arange: start and end must be finite");
  const int64_t n = std::max<int64_t>(0, int64_t(std::ceil((end - start) / step)));
  Attrs a = shape_attrs({n}, dtype, device);
  a.set("start", start).set("step", step);
  return dispatch1(kArange, {}, a);
}

static Attrs random_attrs(const Shape& shape, DType dtype, Device device, Generator* gen, uint64_t per_block) {
  Generator& g = gen ? *gen : default_generator();
  Attrs a = shape_attrs(shape, dtype, device);
  // Philox blocks give 4 numbers; reserve enough for numel values.
  const uint64_t n = uint64_t(numel(shape));
  const uint64_t offset = g.draw(n * 4 / per_block);
  a.set("seed", int64_t(g.seed())).set("offset", int64_t(offset));
  return a;
}

Tensor rand(const Shape& shape, DType dtype, Device device, Generator* gen) {
  BLU_CHECK(is_floating(dtype), "rand: expected a floating dtype, got ", dtype);
  return dispatch1(kRand, {}, random_attrs(shape, dtype, device, gen, 4));
}
Tensor randn(const Shape& shape, DType dtype, Device device, Generator* gen) {
  BLU_CHECK(is_floating(dtype), "randn: expected a floating dtype, got ", dtype);
  return dispatch1(kRandn, {}, random_attrs(shape, dtype, device, gen, 4));
}
Tensor randint(int64_t low, int64_t high, const Shape& shape, DType dtype, Device device, Generator* gen) {
  BLU_CHECK(high > low, "randint: empty range [", low, ", ", high, ")");
  Attrs a = random_attrs(shape, dtype, device, gen, 4);
  a.set("low", low).set("high", high);
  return dispatch1(kRandint, {}, a);
}

Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype) {
  BLU_CHECK(int64_t(values.size()) == numel(shape), "from_vector: ", values.size(), " values for shape ", shape);
  Tensor t = empty(shape, dtype);
  BLU_DISPATCH_ALL(dtype, "from_vector", {
    auto* p = t.data<scalar_t>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = scalar_t(values[i]);
  });
  return t;
}

std::vector<double> to_vector(const Tensor& t) {
  if (t.device().is_cpu()) count_host_read();  // a device tensor's read is counted by its copy
  Tensor c = contiguous(to_device(t, kCPU));
  std::vector<double> v(size_t(c.numel()));
  BLU_DISPATCH_ALL(c.dtype(), "to_vector", {
    const auto* p = c.data<scalar_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = double(p[i]);
  });
  return v;
}

}  // namespace blu
