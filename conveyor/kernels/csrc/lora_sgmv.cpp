// LoRA's low-rank products for a whole step in one call per linear: S-LoRA / Punica's SGMV on the CPU.
//
// y[rows of segment s] += (x[rows] @ A_s^T) @ Bt_s for every segment s of the step (one adapter's rows),
// with A_s [R, in] (the adapted projections' A matrices stacked) and Bt_s [R, out] (their scaled B
// matrices, transposed and placed block-diagonally). Why compiled: in torch each segment costs two small
// matmuls, ~20 us each in bf16 whatever their size, and a step with 16 adapters has 16 segments in each
// of a model's 120 linears: ~80 ms of dispatch for a few ms of math.
//
// What bounds it: at 64 decode rows over 16 adapters every adapter's weights are read once per step
// (its rows form one block), ~160 MB for SmolLM2 with rank 16 on all seven projections: the kernel must
// run at memory speed. So
//   - the shrink t[j][r] = x[j] . A[r] is a dot product over `in` with A's rows as peft stores them
//     (contiguous), 4 rank rows x up to 4 input rows of accumulators; in bf16 on AVX512-BF16 it is
//     vdpbf16ps (32 products an instruction), elsewhere 16-lane fp32 partial sums the compiler
//     vectorizes; each partial-sum vector is reduced in one fixed order at the end;
//   - the expand reads only Bt's non-zero blocks (a fused q/k/v adapter's Bt is 2/3 zeros), fp32
//     accumulation over r in order, 64 output columns x up to 4 rows of accumulators;
//   - y = y + acc is rounded once.
// Every row's sums run in the same order whatever block of work it is in (the blocks only share weight
// loads between rows), so a row's result depends only on its own inputs and its adapter: batch-invariant
// by construction, whether its segment has 1 row or 500.

#include "kernel_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CONVEYOR_LORA_AVX512 1
#else
#define CONVEYOR_LORA_AVX512 0
#endif
#if CONVEYOR_LORA_AVX512 && defined(__AVX512BF16__)
#define CONVEYOR_LORA_DPBF16 1
#else
#define CONVEYOR_LORA_DPBF16 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const bf16* p, int64_t i) {
  uint32_t u = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

constexpr int kRows = 4;   // input rows per block of work: each weight loaded once serves 4 rows
constexpr int kRanks = 4;  // rank rows per shrink tile
constexpr int kLanes = 16;

// y[o] = round(y[o] + acc[o]) for a row: rounding to bf16 in integer ops (round to nearest even, as
// torch's BFloat16 does for finite values), which vectorizes.
inline void add_row(float* __restrict y, const float* __restrict acc, int64_t n) {
#pragma omp simd
  for (int64_t o = 0; o < n; ++o) y[o] += acc[o];
}
inline void add_row(bf16* __restrict y, const float* __restrict acc, int64_t n) {
  uint16_t* yr = reinterpret_cast<uint16_t*>(y);
#pragma omp simd
  for (int64_t o = 0; o < n; ++o) {
    uint32_t u = static_cast<uint32_t>(yr[o]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    f += acc[o];
    std::memcpy(&u, &f, sizeof u);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    u += 0x7fffu + ((u >> 16) & 1u);
    yr[o] = nan ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(u >> 16);
  }
}

// 16 partial sums, added in one fixed order (pairwise), whatever the caller
inline float reduce16(const float* p) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) s[i] += s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// The portable shrink: t[j][r] = x[row0 + j] . A[r] for NB rows, with 16-lane fp32 partial sums.
template <typename T, int NB>
void shrink(const T* __restrict x, int64_t row0, int64_t in, const T* __restrict a, int64_t r_n,
            float* __restrict t) {
  const int64_t full = in / kLanes * kLanes;
  for (int64_t r0 = 0; r0 < r_n; r0 += kRanks) {
    const int rb = static_cast<int>(std::min<int64_t>(kRanks, r_n - r0));
    float acc[NB][kRanks][kLanes] = {};
    for (int64_t k = 0; k < full; k += kLanes) {
      for (int q = 0; q < rb; ++q) {
        const T* ar = a + (r0 + q) * in + k;
        for (int j = 0; j < NB; ++j) {
          const T* xr = x + (row0 + j) * in + k;
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) acc[j][q][l] += load(xr, l) * load(ar, l);
        }
      }
    }
    for (int64_t k = full; k < in; ++k)  // the tail lands in the lanes its position names
      for (int q = 0; q < rb; ++q)
        for (int j = 0; j < NB; ++j)
          acc[j][q][k - full] += load(x + (row0 + j) * in, k) * load(a + (r0 + q) * in, k);
    for (int j = 0; j < NB; ++j)
      for (int q = 0; q < rb; ++q) t[j * r_n + r0 + q] = reduce16(acc[j][q]);
  }
}

#if CONVEYOR_LORA_DPBF16
// The bf16 shrink on AVX512-BF16: 32 products per vdpbf16ps, the tail masked (zeros add nothing).
template <int NB>
void shrink_dpbf16(const bf16* __restrict x, int64_t row0, int64_t in, const bf16* __restrict a, int64_t r_n,
                   float* __restrict t) {
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  const uint16_t* as = reinterpret_cast<const uint16_t*>(a);
  for (int64_t r0 = 0; r0 < r_n; r0 += kRanks) {
    const int rb = static_cast<int>(std::min<int64_t>(kRanks, r_n - r0));
    __m512 acc[NB][kRanks];
    for (int j = 0; j < NB; ++j)
      for (int q = 0; q < kRanks; ++q) acc[j][q] = _mm512_setzero_ps();
    const int64_t next = std::min<int64_t>(kRanks, std::max<int64_t>(0, r_n - r0 - kRanks));
    for (int64_t k = 0; k < in; k += 32) {
      // the weights come from memory (a step reads every adapter once) in rows too short for the
      // hardware prefetcher: fetch the next tile's rows while this one computes
      for (int q = 0; q < next; ++q) __builtin_prefetch(as + (r0 + kRanks + q) * in + k, 0, 3);
      const __mmask32 m = in - k >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (in - k)) - 1u);
      __m512bh w[kRanks];
      for (int q = 0; q < rb; ++q) w[q] = (__m512bh)_mm512_maskz_loadu_epi16(m, as + (r0 + q) * in + k);
      for (int j = 0; j < NB; ++j) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xs + (row0 + j) * in + k);
        for (int q = 0; q < rb; ++q) acc[j][q] = _mm512_dpbf16_ps(acc[j][q], xv, w[q]);
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int q = 0; q < rb; ++q) {
        alignas(64) float lanes[kLanes];
        _mm512_store_ps(lanes, acc[j][q]);
        t[j * r_n + r0 + q] = reduce16(lanes);
      }
  }
}
#endif

template <typename T, int NB>
void shrink_rows(const T* x, int64_t row0, int64_t in, const T* a, int64_t r_n, float* t) {
#if CONVEYOR_LORA_DPBF16
  if constexpr (std::is_same_v<T, bf16>) return shrink_dpbf16<NB>(x, row0, in, a, r_n, t);
#endif
  shrink<T, NB>(x, row0, in, a, r_n, t);
}

// y[row0 + j, o0:o0+on] += t[j, r0:r0+rn] @ Bt[r0:r0+rn, o0:o0+on]: fp32 sums over r in order.
template <typename T, int NB>
void expand(T* __restrict y, int64_t row0, int64_t out, const T* __restrict b, const float* __restrict t,
            int64_t r_n, int64_t r0, int64_t rn, int64_t o0, int64_t on) {
  constexpr int OT = 64;
  for (int64_t c0 = o0; c0 < o0 + on; c0 += OT) {
    const int64_t cn = std::min<int64_t>(OT, o0 + on - c0);
    float acc[NB][OT] = {};
    for (int64_t r = r0; r < r0 + rn; ++r) {
      float tv[NB];
      for (int j = 0; j < NB; ++j) tv[j] = t[j * r_n + r];
      const T* br = b + r * out + c0;
      if (cn == OT) {
#pragma omp simd
        for (int o = 0; o < OT; ++o) {
          const float w = load(br, o);
          for (int j = 0; j < NB; ++j) acc[j][o] += tv[j] * w;
        }
      } else {
        for (int o = 0; o < cn; ++o) {
          const float w = load(br, o);
          for (int j = 0; j < NB; ++j) acc[j][o] += tv[j] * w;
        }
      }
    }
    for (int j = 0; j < NB; ++j) add_row(y + (row0 + j) * out + c0, acc[j], cn);
  }
}

#if CONVEYOR_LORA_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The expand with its 4 x NB accumulators in registers (the compiler's version of the loop above keeps
// them on the stack). The same sums in the same order as `expand`: one FMA per (r, column), r in order.
template <typename T, int NB>
void expand_avx512(T* __restrict y, int64_t row0, int64_t out, const T* __restrict b, const float* __restrict t,
                   int64_t r_n, int64_t r0, int64_t rn, int64_t o0, int64_t on) {
  constexpr int OT = 64;
  const int64_t full = o0 + on / OT * OT;
  for (int64_t c0 = o0; c0 < full; c0 += OT) {
    __m512 acc[NB][4];
    for (int j = 0; j < NB; ++j)
      for (int v = 0; v < 4; ++v) acc[j][v] = _mm512_setzero_ps();
    for (int64_t r = r0; r < r0 + rn; ++r) {
      const T* br = b + r * out + c0;
      if (c0 + OT < full) {  // the next 64 columns of this row (2 lines in bf16, 4 in fp32)
        for (int64_t off = 0; off < OT * static_cast<int64_t>(sizeof(T)); off += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(br + OT) + off, 0, 3);
      }
      __m512 w[4];
      for (int v = 0; v < 4; ++v) w[v] = load16(br + 16 * v);
      for (int j = 0; j < NB; ++j) {
        const __m512 tv = _mm512_set1_ps(t[j * r_n + r]);
        for (int v = 0; v < 4; ++v) acc[j][v] = _mm512_fmadd_ps(tv, w[v], acc[j][v]);
      }
    }
    alignas(64) float row[OT];
    for (int j = 0; j < NB; ++j) {
      for (int v = 0; v < 4; ++v) _mm512_store_ps(row + 16 * v, acc[j][v]);
      add_row(y + (row0 + j) * out + c0, row, OT);
    }
  }
  if (full < o0 + on) expand<T, NB>(y, row0, out, b, t, r_n, r0, rn, full, o0 + on - full);
}
#endif

// Ask for [p, p + bytes) ahead of use, a cache line at a time.
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// One block of work: rows [row0, row0 + NB) of segment s. `next`: the segment of this thread's next block
// (-1: none); when it is another adapter, its first shrink tile is fetched while this block expands, and
// this block's first expand tiles while it shrinks, so that memory latency overlaps the math.
template <typename T, int NB>
void rows_block(const LoRAArgs& p, int64_t row0, int64_t s, int64_t next, float* t) {
  const T* a = static_cast<const T*>(p.a[s]);
  const T* b = static_cast<const T*>(p.bt[s]);
  const int64_t r_n = p.rank[s];
  const int64_t* blk = p.blocks[s];
  for (int64_t i = 0; i < p.num_blocks[s]; ++i)
    for (int64_t r = blk[4 * i]; r < blk[4 * i] + blk[4 * i + 1]; ++r)
      prefetch_span(b + r * p.out + blk[4 * i + 2], std::min<int64_t>(64, blk[4 * i + 3]) * sizeof(T));
  shrink_rows<T, NB>(static_cast<const T*>(p.x), row0, p.in, a, r_n, t);
  if (next >= 0 && next != s && p.rank[next] > 0)
    prefetch_span(p.a[next], std::min<int64_t>(kRanks, p.rank[next]) * p.in * sizeof(T));
  for (int64_t i = 0; i < p.num_blocks[s]; ++i, blk += 4)
#if CONVEYOR_LORA_AVX512
    expand_avx512<T, NB>(static_cast<T*>(p.y), row0, p.out, b, t, r_n, blk[0], blk[1], blk[2], blk[3]);
#else
    expand<T, NB>(static_cast<T*>(p.y), row0, p.out, b, t, r_n, blk[0], blk[1], blk[2], blk[3]);
#endif
}

template <typename T>
void sgmv(const LoRAArgs& p, int64_t r_max) {
  parallel_for(0, p.num_work, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(kRows * r_max);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row0 = p.work[3 * i], nb = p.work[3 * i + 1], s = p.work[3 * i + 2];
      const int64_t next = i + 1 < end ? p.work[3 * (i + 1) + 2] : -1;
      switch (nb) {
        case 4: rows_block<T, 4>(p, row0, s, next, t.data()); break;
        case 3: rows_block<T, 3>(p, row0, s, next, t.data()); break;
        case 2: rows_block<T, 2>(p, row0, s, next, t.data()); break;
        default: rows_block<T, 1>(p, row0, s, next, t.data()); break;
      }
    }
  });
}

}  // namespace

// y [n, out] += per block of work (first row, rows <= 4, segment) its segment's low-rank product; the
// bindings check the shapes and build `work`.
void lora_sgmv(const LoRAArgs& p) {
  int64_t r_max = 0;
  for (int64_t i = 0; i < p.num_work; ++i) r_max = std::max(r_max, p.rank[p.work[3 * i + 2]]);
  if (p.dtype == DType::F32)
    sgmv<float>(p, r_max);
  else
    sgmv<bf16>(p, r_max);
}

void register_lora_sgmv(Table& t) { t.lora_sgmv = &lora_sgmv; }

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
