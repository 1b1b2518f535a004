// ops/factory: tensors made from nothing — empty, filled, ranges, random (Philox) and from host
// values. Random ops take their stream from a Generator (the default one unless given), so a
// seed reproduces them on any device.
// Depends on ops/dispatch. Keep: every factory goes through dispatch (the compiler sees them).
#pragma once
#include <vector>

#include "blu/core/rng.h"
#include "blu/core/tensor.h"

namespace blu {

Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = kCPU);
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
// start, start+step, ... < end
Tensor arange(double start, double end, double step = 1, DType dtype = DType::i64, Device device = kCPU);
inline Tensor arange(int64_t end, DType dtype = DType::i64, Device device = kCPU) { return arange(0, double(end), 1, dtype, device); }
// Uniform [0, 1), standard normal, integers in [low, high).
Tensor rand(const Shape& shape, DType dtype = DType::f32, Device device = kCPU, Generator* gen = nullptr);
Tensor randn(const Shape& shape, DType dtype = DType::f32, Device device = kCPU, Generator* gen = nullptr);
Tensor randint(int64_t low, int64_t high, const Shape& shape, DType dtype = DType::i64, Device device = kCPU,
               Generator* gen = nullptr);
// Sets every element of t to value (in place).
const Tensor& fill_(const Tensor& t, double value);
// A CPU tensor holding `values` (converted to dtype) in the given shape.
Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype = DType::f32);
// All elements as doubles, in logical (row-major) order (copied to the host first). One host read
// (core/host_reads.h).
std::vector<double> to_vector(const Tensor& t);

}  // namespace blu
