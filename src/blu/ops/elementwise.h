// ops/elementwise: pointwise math with NumPy broadcasting — unary functions, binary arithmetic,
// comparisons, where/masked_fill, scalar forms and in-place accumulation.
// Depends on ops/dispatch. Keep: binary ops need equal dtypes (BLU_CHECK otherwise; cast first),
// comparisons give bool, 16-bit floats compute in fp32 and round once per op (as PyTorch's CPU).
#pragma once
#include "blu/core/tensor.h"

namespace blu {

// Unary, floating dtypes.
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
// approximate=false: x·Φ(x) with erf; true: the tanh form GPT-2 uses.
Tensor gelu(const Tensor& x, bool approximate = false);
// d gelu(x)/dx · grad, the kernel gelu's backward uses (for ops that recompute GELU).
Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool approximate = false);
// {gelu(x), gelu_backward(grad, x)} in one pass (CUDA: one read of x): for ops that recompute
// GELU in their backward and need both (gelu_linear). Not differentiable.
std::vector<Tensor> gelu_and_backward(const Tensor& grad, const Tensor& x, bool approximate = false);
Tensor abs(const Tensor& x);
Tensor sign(const Tensor& x);  // not differentiable (zero gradient)
Tensor clamp(const Tensor& x, double lo, double hi);  // pass ±infinity for no bound
Tensor pow(const Tensor& x, double exponent);
Tensor add(const Tensor& x, double s);
Tensor mul(const Tensor& x, double s);

// Binary with broadcasting; equal dtypes.
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);

// Comparisons (bool result, no gradient); the scalar forms compare against a constant.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double s);
Tensor lt(const Tensor& a, double s);
Tensor gt(const Tensor& a, double s);

// cond ? a : b, broadcast; cond is bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// x with `value` where mask (bool, broadcast to x) is true.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);

// In place, no autograd: a += b and a *= b (b broadcast to a, of a's dtype), a *= s.
const Tensor& add_(const Tensor& a, const Tensor& b);
const Tensor& mul_(const Tensor& a, const Tensor& b);
const Tensor& mul_(const Tensor& a, double s);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double s) { return add(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return add(a, -s); }
inline Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return mul(a, 1.0 / s); }
inline Tensor operator*(double s, const Tensor& a) { return mul(a, s); }
inline Tensor operator+(double s, const Tensor& a) { return add(a, s); }
inline Tensor operator-(double s, const Tensor& a) { return add(neg(a), s); }

}  // namespace blu
