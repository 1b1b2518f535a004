// Flash-attention forward on CUDA: the "flash_attention" kernel of ops/attention.cpp.
//
// Tensor-core kernel (bf16/f16), the FlashAttention-2 scheme: a CTA of 4 warps owns a tile of
// 64 query rows (16 per warp, Q fragments kept in registers) and walks the K/V tiles of 64 keys,
// double-buffered in swizzled shared memory by cp.async (tile n+1 loads while tile n computes).
// Per tile each warp computes S = Q·Kᵀ (16x64, fp32), masks (causal diagonal, sequence tail),
// updates the running row max m and row sum l (online softmax in exp2 with scale·log2e folded in),
// rescales its O accumulator and adds P·V with P converted to 16-bit straight from the S
// registers. Causal: a query tile stops at the diagonal tile (fully masked tiles are skipped) and
// CTAs are launched heaviest-first (q-tile index reversed, in the slowest grid dimension).
//
// On Hopper (sm_90a build, compute capability 9.0) bf16/f16 go to the wgmma kernel of
// flash_attention_wgmma.cu instead (set_flash_attention_wgmma(false) keeps them here).
//
// f32: the TF32 tensor-core kernels of flash_attention_tf32.cu.
// GQA (p.group > 1): every forward kernel reads query head h's K and V from key/value head
// h / group in place (one integer division per CTA or row; no copy, no expansion).
#include "blu/backend/backend.h"
#include "blu/backend/cuda/flash_attention.cuh"
#include "blu/backend/cuda/flash_attention_f32.h"
#include "blu/backend/cuda/flash_attention_wgmma.h"
#include "blu/backend/cuda/runtime.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <queue>
#include <vector>
#include <cstdlib>
#include <iterator>
#include <string_view>
#include <cmath>

namespace blu::cuda {

namespace flash {

// ---------------------------------------------------------------------------------------------
// Tensor-core forward.
constexpr int kFwdBQ = 64, kFwdBK = 64, kFwdThreads = 128;

template <int D>
constexpr int fwd_smem_bytes() {
  return (kFwdBQ * D + 2 * kFwdBK * D * 2) * 2;  // Q, two stages of K and V, 16-bit elements
}

template <typename T, int D>
__global__ void __launch_bounds__(kFwdThreads) flash_fwd_mma_kernel(FlashFwdParams p) {
  constexpr int BQ = kFwdBQ, BK = kFwdBK;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BQ][D]
  T* sK = sQ + BQ * D;                     // [2][BK][D]
  T* sV = sK + 2 * BK * D;                 // [2][BK][D]

  const auto [b, h, q0] = fwd_tile<BQ>(p);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  const T* Qg = slice<T>(p.q, b, h);
  const T* Kg = slice<T>(p.k, b, h / p.group);  // the query head's key/value head (GQA)
  const T* Vg = slice<T>(p.v, b, h / p.group);
  const int kv_end = p.causal ? min(p.T, q0 + BQ) : p.T;
  const int num_kt = (kv_end + BK - 1) / BK;

  load_tile_async<T, D, BQ, kFwdThreads>(sQ, Qg, p.q.st, q0, p.T, tid);
  load_tile_async<T, D, BK, kFwdThreads>(sK, Kg, p.k.st, 0, p.T, tid);
  load_tile_async<T, D, BK, kFwdThreads>(sV, Vg, p.v.st, 0, p.T, tid);
  cp_async_commit();

  uint32_t qf[D / 16][4];  // this warp's 16 Q rows as A fragments, one per 16-column k step
  float o[D / 8][4];       // O accumulator: n-tile j holds columns 8j..8j+7
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {kNegInf, kNegInf};  // running max of the raw scores, rows g and g+8
  float l[2] = {0.f, 0.f};          // running sum of exp, this thread's columns only
  const float sl2 = p.scale * kLog2e;
  const int row_lo = q0 + warp * 16 + g;  // rows row_lo and row_lo + 8

  for (int kt = 0; kt < num_kt; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < num_kt) {
      const int nxt = stage ^ 1;
      load_tile_async<T, D, BK, kFwdThreads>(sK + nxt * BK * D, Kg, p.k.st, (kt + 1) * BK, p.T, tid);
      load_tile_async<T, D, BK, kFwdThreads>(sV + nxt * BK * D, Vg, p.v.st, (kt + 1) * BK, p.T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (kt == 0) {
      // A fragments: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], sQ + swz<D>(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 16 + (lane >> 4) * 8));
    }
    const T* k_s = sK + stage * BK * D;
    const T* v_s = sV + stage * BK * D;

    // S = Q·Kᵀ. B[k=d][n=key] = K[key][d]: non-transposed 8x8 blocks of K; x4 matrices
    // (keys 0-7, d 0-7) → b0, (keys 0-7, d 8-15) → b1 of n-tile 2nn; keys 8-15 → n-tile 2nn+1.
    float s[BK / 8][4];
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BK / 16; ++nn) {
        uint32_t r[4];
        ldmatrix_x4(r, k_s + swz<D>(nn * 16 + (lane & 7) + (lane >> 4) * 8, kk * 16 + ((lane >> 3) & 1) * 8));
        mma_16816<T>(s[2 * nn], qf[kk], r[0], r[1]);
        mma_16816<T>(s[2 * nn + 1], qf[kk], r[2], r[3]);
      }
    }

    // Mask the diagonal tile (causal) and keys past the end.
    const int k0 = kt * BK;
    if (k0 + BK > p.T || (p.causal && k0 + BK - 1 > q0 + warp * 16)) {
#pragma unroll
      for (int j = 0; j < BK / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + j * 8 + 2 * t + (e & 1);
          const int row = row_lo + (e >> 1) * 8;
          if (key >= p.T || (p.causal && key > row)) s[j][e] = kNegInf;
        }
    }

    // Online softmax over this tile (rows g: elements 0,1; row g+8: elements 2,3). A row's 64
    // columns are spread over the 4 threads of a quad: reduce the max with two xor-shuffles.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float msub = mx == kNegInf ? 0.f : mx * sl2;  // a fully masked row so far stays at 0
      const float alpha = fast_exp2(m[r] * sl2 - msub);
      m[r] = mx;
      float rs = 0.f;
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
        s[j][2 * r] = fast_exp2(s[j][2 * r] * sl2 - msub);
        s[j][2 * r + 1] = fast_exp2(s[j][2 * r + 1] * sl2 - msub);
        rs += s[j][2 * r] + s[j][2 * r + 1];
      }
      l[r] = l[r] * alpha + rs;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
    }

    // O += P·V. A = P (16 x keys) from the S accumulators: k step kk covers keys 16kk..16kk+15,
    // a0/a1 from n-tile 2kk (rows g / g+8), a2/a3 from n-tile 2kk+1. B[k=key][n=d] = V[key][d]:
    // transposed 8x8 blocks; x4 matrices (keys 0-7, d 0-7) → b0, (keys 8-15, d 0-7) → b1 of
    // n-tile 2nn; d 8-15 → n-tile 2nn+1.
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[4];
      a[0] = Elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      a[1] = Elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      a[2] = Elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = Elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int nn = 0; nn < D / 16; ++nn) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, v_s + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nn * 16 + (lane >> 4) * 8));
        mma_16816<T>(o[2 * nn], a, r[0], r[1]);
        mma_16816<T>(o[2 * nn + 1], a, r[2], r[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next prefetch overwrites it
  }

  // Epilogue: complete the row sums across the quad, normalise, store O and the logsumexp.
  T* Og = slice_mut<T>(p.o, b, h);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    const int row = row_lo + r * 8;
    if (row >= p.T) continue;
    const float inv = lr > 0.f ? 1.f / lr : 0.f;
    T* orow = Og + int64_t(row) * p.o.st;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(orow + j * 8 + 2 * t) = Elem<T>::pack(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
    if (t == 0) p.lse[(int64_t(b) * p.H + h) * p.T + row] = lr > 0.f ? m[r] * p.scale + logf(lr) : kNegInf;
  }
}

// ---------------------------------------------------------------------------------------------
template <typename T, int D>
void launch_fwd_mma(const FlashFwdParams& p, cudaStream_t stream) {
  launch_tiles<flash_fwd_mma_kernel<T, D>>(p, kFwdBQ, kFwdThreads, fwd_smem_bytes<D>(), "flash_attention", stream);
}

template <int D>
void fwd_dispatch_d(const FlashFwdParams& p, DType dtype, cudaStream_t s) {
  if ((dtype == DType::bf16 || dtype == DType::f16) && flash_attention_wgmma() && flash_attention_wgmma_available())
    return flash_attention_forward_wgmma(p, dtype, s);
  switch (dtype) {
    case DType::f32: return flash_attention_forward_f32(p, s);
    case DType::bf16: return launch_fwd_mma<__nv_bfloat16, D>(p, s);
    case DType::f16: return launch_fwd_mma<__half, D>(p, s);
    default: BLU_ASSERT(false, "flash_attention: unsupported dtype ", dtype);
  }
}

}  // namespace flash

namespace {
// BLU_FLASH_WGMMA=0 in the environment starts with the wgmma forward off (the mma.sync one runs).
std::atomic<bool> g_wgmma{[] {
  const char* e = std::getenv("BLU_FLASH_WGMMA");
  return !(e && std::string_view(e) == "0");
}()};
}  // namespace

void set_flash_attention_wgmma(bool on) { g_wgmma.store(on); }
bool flash_attention_wgmma() { return g_wgmma.load(); }

int head_group_from_env(int fallback) {
  const char* e = std::getenv("BLU_FLASH_HEAD_GROUP");
  return e ? std::max(0, std::atoi(e)) : fallback;
}
std::atomic<int> g_head_group[2] = {head_group_from_env(kDefaultFwdHeadGroup),
                                    head_group_from_env(kDefaultBwdHeadGroup)};

void set_flash_attention_head_group(bool backward, int heads) { g_head_group[backward].store(std::max(0, heads)); }
int flash_attention_head_group(bool backward) { return g_head_group[backward].load(); }


namespace {
// The time the CTAs of a (kv_heads, ranks) grid in head groups of g take when each multiprocessor
// runs one at a time and takes the next in launch order as it frees: a CTA of key tile kb walks
// group · (query_tiles − 2·kb) query tiles under causal (group · query_tiles otherwise), plus one
// tile's worth for loading K, V and storing dK, dV.
double simulated_makespan(int kv_heads, int ranks, int query_tiles, int group, bool causal, int sms, int g) {
  std::priority_queue<double, std::vector<double>, std::greater<>> free_at;
  for (int i = 0; i < sms; ++i) free_at.push(0.0);
  double end = 0;
  for (int lin = 0; lin < kv_heads * ranks; ++lin) {
    const int kb = tile_slot_of(lin, kv_heads, ranks, g).rank;
    const double work = group * double(causal ? std::max(query_tiles - 2 * kb, 1) : query_tiles) + 1;
    const double t = free_at.top() + work;
    free_at.pop();
    free_at.push(t);
    end = std::max(end, t);
  }
  return end;
}
}  // namespace

int gqa_backward_head_group(int kv_heads, int ranks, int query_tiles, int group, bool causal, int sms,
                            int preferred) {
  if (preferred <= 0) return 0;
  if (preferred >= kv_heads) return kv_heads;
  // Past 8 waves of CTAs the launch order moves the end by little (a few heavy CTAs among many):
  // keep the L2's choice.
  if (int64_t(kv_heads) * ranks > int64_t(8) * sms) return preferred;
  static std::mutex mu;
  static std::map<std::array<int, 7>, int> chosen;
  const std::array<int, 7> key{kv_heads, ranks, query_tiles, group, int(causal), sms, preferred};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = chosen.find(key); it != chosen.end()) return it->second;
  std::vector<std::pair<int, double>> candidates;  // preferred, doubled, ..., then all of them
  for (int g = preferred; g < kv_heads; g *= 2)
    candidates.emplace_back(g, simulated_makespan(kv_heads, ranks, query_tiles, group, causal, sms, g));
  candidates.emplace_back(kv_heads, simulated_makespan(kv_heads, ranks, query_tiles, group, causal, sms, kv_heads));
  double best = candidates[0].second;
  for (const auto& c : candidates) best = std::min(best, c.second);
  int pick = kv_heads;
  for (const auto& c : candidates)
    if (c.second <= 1.02 * best) {
      pick = c.first;
      break;
    }
  return chosen[key] = pick;
}

bool flash_attention_supported(DType dtype, int64_t head_dim) {
  return (dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16) && (head_dim == 64 || head_dim == 128);
}
bool flash_attention_needs_dq_accum(DType dtype) {
  return dtype == DType::bf16 || dtype == DType::f16;
}

void flash_attention_forward(const FlashFwdParams& params, DType dtype, cudaStream_t stream) {
  BLU_ASSERT(flash_attention_supported(dtype, params.D), "flash_attention_forward: ", dtype, " D=", params.D);
  if (int64_t(params.B) * params.H * params.T == 0) return;
  FlashFwdParams p = params;
  p.head_group = flash_attention_head_group(false);
  if (p.D == 64) flash::fwd_dispatch_d<64>(p, dtype, stream);
  else flash::fwd_dispatch_d<128>(p, dtype, stream);
}

namespace {

// "flash_attention": in q [B, H, T, D], k, v [B, Hkv, T, D] (strided, see flash_attention.h);
// attrs causal, scale. Out: o as a contiguous [B, T, H, D] buffer, lse [B, H, T] f32.
void flash_attention_kernel(const KernelCall& c) {
  const Tensor &q = c.in[0], &k = c.in[1], &v = c.in[2];
  FlashFwdParams p;
  p.q = operand_bhtd(q);
  p.k = operand_bhtd(k);
  p.v = operand_bhtd(v);
  p.o = operand_bthd(c.out[0]);
  p.lse = static_cast<float*>(c.out[1].raw_data());
  p.B = int(q.size(0));
  p.H = int(q.size(1));
  p.T = int(q.size(2));
  p.D = int(q.size(3));
  p.group = std::max(1, p.H / int(k.size(1)));  // (the op checked H % Hkv == 0)
  p.scale = float(c.attrs.f("scale"));
  p.causal = c.attrs.b("causal");
  flash_attention_forward(p, q.dtype(), stream_of(c.ctx));
}

BLU_REGISTER_KERNEL(cuda, "flash_attention", flash_attention_kernel);

}  // namespace

}  // namespace blu::cuda
