// backend/cpu/loops: the strided iteration every CPU kernel builds on. An operand is a base
// pointer plus strides (elements) aligned to the iteration shape, broadcast dims having stride 0.
// `strided_loop` walks all positions (OpenMP-parallel over chunks when large), handing the kernel
// each operand's element offset; a fully contiguous call gets the fast path of offsets == index.
// Depends on core/. Keep: kernels see offsets, never coordinates, so any layout works.
#pragma once
#include <omp.h>

#include <array>
#include <cstdint>

#include "blu/core/tensor.h"

namespace blu::cpu {

// Strides of `t` seen from `shape` (t broadcast to it: leading and size-1 dims get stride 0).
Shape broadcast_strides(const Tensor& t, const Shape& shape);

inline constexpr int64_t kGrain = 32768;  // elements per thread below which we stay serial

// f(index, offsets) for every position of `shape`; offsets[k] is operand k's element offset.
template <size_t N, typename F>
void strided_loop(const Shape& shape, const std::array<Shape, N>& strides, F&& f) {
  const int64_t total = numel(shape);
  if (total == 0) return;
  const int64_t nd = int64_t(shape.size());
  bool contiguous = true;
  const Shape cs = contiguous_strides(shape);
  for (size_t k = 0; k < N && contiguous; ++k)
    for (int64_t d = 0; d < nd; ++d)
      if (shape[d] != 1 && strides[k][d] != cs[d]) contiguous = false;
  const int nthreads = total >= 2 * kGrain ? omp_get_max_threads() : 1;
  if (contiguous) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < total; ++i) {
      std::array<int64_t, N> off;
      off.fill(i);
      f(i, off);
    }
    return;
  }
  const int64_t inner = nd == 0 ? 1 : shape[nd - 1];
#pragma omp parallel num_threads(nthreads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t rows = total / inner;
    const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
    std::array<int64_t, 16> coord{};
    std::array<int64_t, N> base{};
    // Unravel row r0 into coordinates of dims [0, nd-1).
    int64_t r = r0;
    for (int64_t d = nd - 2; d >= 0; --d) {
      coord[d] = r % shape[d];
      r /= shape[d];
    }
    for (size_t k = 0; k < N; ++k) {
      base[k] = 0;
      for (int64_t d = 0; d + 1 < nd; ++d) base[k] += coord[d] * strides[k][d];
    }
    for (int64_t row = r0; row < r1; ++row) {
      std::array<int64_t, N> off = base;
      for (int64_t j = 0; j < inner; ++j) {
        f(row * inner + j, off);
        for (size_t k = 0; k < N; ++k) off[k] += nd ? strides[k][nd - 1] : 0;
      }
      for (int64_t d = nd - 2; d >= 0; --d) {  // next row
        for (size_t k = 0; k < N; ++k) base[k] += strides[k][d];
        if (++coord[d] < shape[d]) break;
        for (size_t k = 0; k < N; ++k) base[k] -= coord[d] * strides[k][d];
        coord[d] = 0;
      }
    }
  }
}

// The type arithmetic on scalar_t is done in: float for the 16-bit types, else itself.
template <typename T> struct acc_type { using type = T; };
template <> struct acc_type<bf16> { using type = float; };
template <> struct acc_type<f16> { using type = float; };
template <typename T> using acc_t = typename acc_type<T>::type;

// out[i] = f(in...[i]) with in broadcast to out's shape; types converted through acc. When every
// operand is contiguous with out's shape, a chunk per thread runs as a plain indexed loop the
// compiler can vectorise (`omp simd`); the result is the same element by element.
template <typename Out, typename In, typename F, typename... Ts>
void map(Tensor& out, F&& f, const Ts&... in) {
  const Shape& shape = out.shape();
  if (sizeof...(Ts) > 0 && out.is_contiguous() && ((in.is_contiguous() && in.shape() == shape) && ...)) {
    const int64_t total = out.numel();
    Out* o = static_cast<Out*>(out.raw_data());
    const std::array<const In*, sizeof...(Ts)> ptrs{static_cast<const In*>(in.raw_data())...};
    const int nthreads = total >= 2 * kGrain ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(nthreads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t i0 = total * t / nt, i1 = total * (t + 1) / nt;
      [&]<size_t... I>(std::index_sequence<I...>) {
        const std::array<const In*, sizeof...(Ts)> p{ptrs[I]...};
#pragma omp simd
        for (int64_t i = i0; i < i1; ++i) o[i] = Out(f(acc_t<In>(p[I][i])...));
      }(std::index_sequence_for<Ts...>{});
    }
    return;
  }
  std::array<Shape, sizeof...(Ts) + 1> strides{out.strides(), broadcast_strides(in, shape)...};
  Out* o = static_cast<Out*>(out.raw_data());
  std::array<const In*, sizeof...(Ts)> ptrs{static_cast<const In*>(in.raw_data())...};
  strided_loop(shape, strides, [&](int64_t, const std::array<int64_t, sizeof...(Ts) + 1>& off) {
    [&]<size_t... I>(std::index_sequence<I...>) {
      o[off[0]] = Out(f(acc_t<In>(ptrs[I][off[I + 1]])...));
    }(std::index_sequence_for<Ts...>{});
  });
}

}  // namespace blu::cpu

namespace blu::cpu {

// Reductions: `reduced[d]` marks the dims folded away. For each output position (kept dims in
// row-major order) calls f(out_index, visit), where visit(g) calls g(offset) for each reduced
// element of that output, in row-major order of the reduced dims. Parallel over outputs.
template <typename F>
void reduce_loop(const Tensor& in, const std::vector<bool>& reduced, F&& f) {
  Shape ks, kst, rs, rst;
  for (int64_t d = 0; d < in.dim(); ++d) {
    (reduced[d] ? rs : ks).push_back(in.shape()[d]);
    (reduced[d] ? rst : kst).push_back(in.strides()[d]);
  }
  const int64_t nout = numel(ks), nred = numel(rs);
  const int64_t base0 = in.offset();
  const int64_t rnd = int64_t(rs.size()), knd = int64_t(ks.size());
  const int nthreads = nout * std::max<int64_t>(nred, 1) >= 2 * kGrain && nout > 1 ? omp_get_max_threads() : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t o = 0; o < nout; ++o) {
    int64_t base = 0, rem = o;
    for (int64_t d = knd - 1; d >= 0; --d) {
      base += (rem % ks[d]) * kst[d];
      rem /= ks[d];
    }
    (void)base0;
    auto visit = [&](auto&& g) {
      if (nred == 0) return;
      std::array<int64_t, 16> c{};
      int64_t off = base;
      const int64_t inner = rnd ? rs[rnd - 1] : 1, istride = rnd ? rst[rnd - 1] : 0;
      for (int64_t done = 0; done < nred; done += inner) {
        int64_t p = off;
        for (int64_t j = 0; j < inner; ++j, p += istride) g(p);
        for (int64_t d = rnd - 2; d >= 0; --d) {
          off += rst[d];
          if (++c[d] < rs[d]) break;
          off -= c[d] * rst[d];
          c[d] = 0;
        }
      }
    };
    f(o, visit);
  }
}

}  // namespace blu::cpu
