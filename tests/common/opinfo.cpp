#include "common/opinfo.h"

#include <cmath>
#include <sstream>

namespace blu::test {

std::vector<OpInfo>& opinfo_registry() {
  static std::vector<OpInfo> r;
  return r;
}
OpInfoRegistrar::OpInfoRegistrar(std::vector<OpInfo> ops) {
  for (auto& op : ops) opinfo_registry().push_back(std::move(op));
}

Tensor rnd(Generator& g, const Shape& shape, DType dtype) { return to_dtype(randn(shape, DType::f64, kCPU, &g), dtype); }
Tensor rnd_positive(Generator& g, const Shape& shape, DType dtype, double lo) {
  return to_dtype(add(rand(shape, DType::f64, kCPU, &g), lo), dtype);
}

Tensor noncontig(const Tensor& t) {
  if (t.dim() < 2) {
    // Every other element of a buffer twice as long.
    Tensor big = zeros({std::max<int64_t>(t.numel(), 1) * 2}, t.dtype(), t.device());
    Tensor v = t.dim() == 0 ? big.alias_with({}, {}, 1) : big.alias_with(t.shape(), {2}, 1);
    copy_(v, t);
    return v;
  }
  // Stored with the last two dims swapped, viewed back.
  Tensor stored = contiguous(transpose(t, -1, -2));
  return transpose(stored, -1, -2);
}

std::string compare(const Tensor& got, const Tensor& want, double atol, double rtol) {
  if (got.shape() != want.shape()) return "shape " + to_string(got.shape()) + " vs " + to_string(want.shape());
  const auto a = to_vector(got), b = to_vector(want);
  double worst = 0;
  int64_t at = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool both_nan = std::isnan(a[i]) && std::isnan(b[i]);
    if (both_nan || a[i] == b[i]) continue;
    const double err = std::abs(a[i] - b[i]), tol = atol + rtol * std::abs(b[i]);
    if (!(err <= tol) && (at < 0 || err / tol > worst)) {
      worst = std::isnan(err) ? INFINITY : err / tol;
      at = int64_t(i);
    }
  }
  if (at < 0) return "";
  std::ostringstream os;
  os.precision(10);
  os << "element " << at << ": got " << a[at] << " want " << b[at] << " (|diff| " << std::abs(a[at] - b[at])
     << ", " << worst << "x the tolerance)";
  return os.str();
}

}  // namespace blu::test
