// bf16 linear layers on AVX2 + FMA: bf16 weights widened to fp32 in registers, fp32 FMAs, for any number of rows.
//
// Why our own: on an AVX2-only CPU (AMD EPYC Zen 3, measured) oneDNN refuses to prepack bf16 weights, and torch's
// own bf16 matmul runs SmolLM2's 576 -> 1536 projection at 64 rows in 7.5 ms, 9x slower than the same shape in
// fp32 on oneDNN's packed layout (0.84 ms). Holding the weights in fp32 instead doubles what a decode step reads.
// This kernel keeps them in bf16 (half the bytes: one stream's step is a read of every weight) and widens each
// loaded vector with one shift and one mask, which AVX2 does at full rate, so the FMAs run at fp32 speed.
//
// Batch invariance by construction: every output element is one chain of fp32 FMAs over k = 0, 1, 2, ... in
// one accumulator, rounded to bf16 once at the end (round to nearest even, as torch rounds). Row blocking,
// column blocking and the thread split decide only which chains run together, never the order inside one, so a
// row's result is the same bits whatever the number of rows beside it.
//
// Weight layout: linear_bf16_pack's [N/16][K/2][16][2] (the AVX-512 BF16 kernel's): for each block of 16 output
// columns, the K pairs in order, each pair of the 16 columns as 16 32-bit words whose low half is the column's
// weight at k = 2p and the high half at k = 2p + 1. One 32-byte load of 8 words gives both: `w << 16` is the
// even k's fp32 value, `w & 0xFFFF0000` the odd k's.

#include "kernel_api.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_HAS_AVX2_LINEAR 1
#else
#define CONVEYOR_HAS_AVX2_LINEAR 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

#if CONVEYOR_HAS_AVX2_LINEAR
#include "linear_common.h"

namespace {

constexpr int kGroup = 6;  // rows per register block: 6 x 2 accumulators + 2 weights + 1 broadcast
// from this many rows, widen each 16-column block once for all rows; below, the direct path (Zen 3, the 1B shape's
// projections, GFLOP/s direct against widened: 100-135 against 54-112 at 6 rows, 107-126 against 51-107 at 8,
// level at 12 (~110-125), 113-132 against 136-153 at 16)
constexpr int64_t kWidenFrom = 12;

// `p`, as a value the compiler cannot see through: loads from it are not merged with earlier loads from `p`
template <typename T>
inline const T* opaque(const T* p) {
  asm volatile("" : "+r"(p));  // volatile: two of these on the same p are not merged either
  return p;
}

// 0xFFFF0000 in every lane, in memory: the direct path's mask for the odd k's weights
alignas(32) constexpr uint32_t kHiMask[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                             0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};

// rows [0, R) of one group of activations (fp32, laid out [K][kGroup]: a k's rows side by side, so that every
// broadcast is a constant offset from one pointer) times NB 16-column blocks from block b0 of the packed weight,
// the whole K. The direct path, for a few rows: each weight is widened as it is used, and read once per row group.
// R * NB * 2 accumulators, (R, NB) in {(1, 4), (2, 3), (3, 2), (4, 1), (5, 1), (6, 1)}: at most 12, which with the two
// widened weight vectors and the broadcast is 15 of the 16 ymm registers. The sums go to `c` ([NB][R][16] fp32,
// 32-byte aligned) and are rounded by store_rows_bf16, out of line, so that no rounding constant competes for those
// registers (the widened path's reason, see there). The (2, 3) and (3, 2) blocks still spilled three accumulators
// through the stack on every k until the broadcasts and the mask were re-read (below): 83-93 GFLOP/s at 2-5 rows on
// a Zen 3 before, where the widened path reaches ~180.
template <int R, int NB>
__attribute__((noinline)) void block(const float* xg, int64_t kp, const uint32_t* w, int64_t b0, float* c) {
  __m256 acc[R][NB][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  const uint32_t* base = w + b0 * kp * 16;
  for (int64_t p = 0; p < kp; ++p, xg += 2 * kGroup) {
    for (int j = 0; j < NB; ++j) {
      const uint32_t* wp = base + (j * kp + p) * 16;
      // a decode step streams the weights from memory: ask for them 2 KiB (32 pairs) ahead of use
      if (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(wp + 32 * 16), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        // From two rows, the broadcasts and the mask are read from memory again for every 8 columns (loads from
        // L1): left to itself, GCC keeps them in registers across the column blocks (2R broadcasts and the
        // mask), and with 12 accumulators the block spilled three of them through the stack on every k. (One
        // row's block has room for its two broadcasts and the mask and reads them once. Its (1, 4) block still
        // keeps a stack copy of its accumulators, stored on every k, never reloaded in the loop; one stream's
        // step is bound by reading the weights from memory, and the probe read it level, so it is left.)
        const float* xq = R >= 2 ? opaque(xg) : xg;
        const float* mask = reinterpret_cast<const float*>(kHiMask);
        if (R >= 2) mask = opaque(mask);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + h * 8));
        const __m256 odd = _mm256_and_ps(_mm256_castsi256_ps(v), _mm256_load_ps(mask));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        for (int r = 0; r < R; ++r) {
          acc[r][j][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xq + r), even, acc[r][j][h]);
          acc[r][j][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xq + kGroup + r), odd, acc[r][j][h]);
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_store_ps(c + (j * R + r) * 16 + h * 8, acc[r][j][h]);
}

// The widened path, for many rows: rows [0, R) of one group times one 16-column block already widened to fp32
// ([K][16], in L2), over k in [k0, k0 + kc): the same chain of FMAs per output as `block`, so the same bits. The
// chain goes on from the fp32 partial sums in `c` ([R][16]; zeros for the first span) and leaves them there (no
// rounding between spans), so K can be cut into spans whose widened weights stay in L2.
template <int R>
inline void block_f32(const float* xg, int64_t kc, const float* wf, float* c) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = _mm256_load_ps(c + r * 16), acc[r][1] = _mm256_load_ps(c + r * 16 + 8);
  for (int64_t i = 0; i < kc; ++i, xg += kGroup, wf += 16) {
    const __m256 w0 = _mm256_loadu_ps(wf), w1 = _mm256_loadu_ps(wf + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xg + r);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_store_ps(c + r * 16, acc[r][0]), _mm256_store_ps(c + r * 16 + 8, acc[r][1]);
}

// block_f32<6> written out, the same FMAs in the same order (so the same bits). Why: the 6 x 16 block takes 15 of
// the 16 ymm registers (12 accumulators, 2 weight vectors, 1 broadcast), and GCC did not keep the array form in
// them: with the rounding inline it hoisted to_bf16's constants into registers and spilled two accumulators
// through the stack on every k; with the rounding out of line it kept all twelve in memory. Either way each k
// waited on a store-to-load chain: 85 GFLOP/s on a Zen 3 whose FMAs peak at ~190 (two cores); in named
// registers, rounded elsewhere (store_rows_bf16), it runs at the FMA rate.
inline void block6_f32(const float* xg, int64_t kc, const float* wf, float* c) {
  __m256 a0 = _mm256_load_ps(c), b0 = _mm256_load_ps(c + 8), a1 = _mm256_load_ps(c + 16), b1 = _mm256_load_ps(c + 24);
  __m256 a2 = _mm256_load_ps(c + 32), b2 = _mm256_load_ps(c + 40), a3 = _mm256_load_ps(c + 48);
  __m256 b3 = _mm256_load_ps(c + 56), a4 = _mm256_load_ps(c + 64), b4 = _mm256_load_ps(c + 72);
  __m256 a5 = _mm256_load_ps(c + 80), b5 = _mm256_load_ps(c + 88);
  for (int64_t i = 0; i < kc; ++i, xg += kGroup, wf += 16) {
    const __m256 w0 = _mm256_loadu_ps(wf), w1 = _mm256_loadu_ps(wf + 8);
    __m256 x = _mm256_broadcast_ss(xg);
    a0 = _mm256_fmadd_ps(x, w0, a0), b0 = _mm256_fmadd_ps(x, w1, b0);
    x = _mm256_broadcast_ss(xg + 1);
    a1 = _mm256_fmadd_ps(x, w0, a1), b1 = _mm256_fmadd_ps(x, w1, b1);
    x = _mm256_broadcast_ss(xg + 2);
    a2 = _mm256_fmadd_ps(x, w0, a2), b2 = _mm256_fmadd_ps(x, w1, b2);
    x = _mm256_broadcast_ss(xg + 3);
    a3 = _mm256_fmadd_ps(x, w0, a3), b3 = _mm256_fmadd_ps(x, w1, b3);
    x = _mm256_broadcast_ss(xg + 4);
    a4 = _mm256_fmadd_ps(x, w0, a4), b4 = _mm256_fmadd_ps(x, w1, b4);
    x = _mm256_broadcast_ss(xg + 5);
    a5 = _mm256_fmadd_ps(x, w0, a5), b5 = _mm256_fmadd_ps(x, w1, b5);
  }
  _mm256_store_ps(c, a0), _mm256_store_ps(c + 8, b0), _mm256_store_ps(c + 16, a1), _mm256_store_ps(c + 24, b1);
  _mm256_store_ps(c + 32, a2), _mm256_store_ps(c + 40, b2), _mm256_store_ps(c + 48, a3);
  _mm256_store_ps(c + 56, b3), _mm256_store_ps(c + 64, a4), _mm256_store_ps(c + 72, b4);
  _mm256_store_ps(c + 80, a5), _mm256_store_ps(c + 88, b5);
}

// one 16-column block of the packed weight (K/2 pairs x 16 words) as fp32 [K][16]
inline void widen(const uint32_t* wb, int64_t kp, float* wf) {
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < kp; ++p, wb += 16, wf += 32)
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + h * 8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wf + h * 8), _mm256_slli_epi32(v, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wf + 16 + h * 8), _mm256_and_si256(v, hi_mask));
    }
}

void rows_f32(int rr, const float* xg, int64_t kc, const float* wf, float* c) {
  switch (rr) {
    case 1: return block_f32<1>(xg, kc, wf, c);
    case 2: return block_f32<2>(xg, kc, wf, c);
    case 3: return block_f32<3>(xg, kc, wf, c);
    case 4: return block_f32<4>(xg, kc, wf, c);
    case 5: return block_f32<5>(xg, kc, wf, c);
    default: return block6_f32(xg, kc, wf, c);
  }
}

// rows [0, rr) (rr < kWidenFrom) times column blocks [b, b + nb), in the widest register blocks that fit.
void group(int rr, const float* xg, int64_t kp, const uint32_t* w, int64_t b, int64_t nb, uint16_t* out, int64_t n) {
  alignas(32) float c[12 * 16];
  // NB column blocks of rr rows from block j: computed, then rounded to bf16 into `out`
  auto run = [&](auto kernel, int blocks, int64_t j) {
    kernel(xg, kp, w, j, c);
    for (int i = 0; i < blocks; ++i) store_rows_bf16(c + i * rr * 16, rr, out + (j + i) * 16, n);
  };
  int64_t j = b;
  // a few rows (a decode step of one to three streams): several column blocks at once, to hide the FMA latency
  if (rr == 1) for (; j + 4 <= b + nb; j += 4) run(block<1, 4>, 4, j);
  if (rr == 2) for (; j + 3 <= b + nb; j += 3) run(block<2, 3>, 3, j);
  if (rr == 3) for (; j + 2 <= b + nb; j += 2) run(block<3, 2>, 2, j);
  for (; j < b + nb; ++j) {
    switch (rr) {
      case 1: run(block<1, 1>, 1, j); break;
      case 2: run(block<2, 1>, 1, j); break;
      case 3: run(block<3, 1>, 1, j); break;
      case 4: run(block<4, 1>, 1, j); break;
      case 5: run(block<5, 1>, 1, j); break;
      default: run(block<6, 1>, 1, j); break;
    }
  }
}

}  // namespace

// out [M, N] = x [M, K] @ W^T, x and W in bf16 (W packed by linear_bf16_pack), fp32 accumulation; the caller
// checks the shapes (K even, N a multiple of 16).
void linear_avx2(const uint16_t* xd, const uint16_t* wd, uint16_t* od, int64_t m, int64_t k, int64_t nblk) {
  const int64_t n = nblk * 16, kp = k / 2, groups = (m + kGroup - 1) / kGroup;
  // the activations widened once (not once per column block), each group of rows as [K][kGroup]; a last group's
  // missing rows are never read (every block reads only its rr rows), so they are left as they are
  float* const xw = scratch_floats(0, static_cast<size_t>(groups * k * kGroup));
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* dst = xw + (r / kGroup) * k * kGroup + r % kGroup;
      for (int64_t i = 0; i < k; ++i) dst[i * kGroup] = bits_to_float(static_cast<uint32_t>(xd[r * k + i]) << 16);
    }
  });
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wd);
  if (m < kWidenFrom) {  // streaming the weights
    constexpr int64_t kColGroup = 8;  // 128 columns: their weights (K x 256 B) stay in L2 across the row groups
    over_blocks_and_rows(nblk, m, kColGroup, kGroup, [&](int64_t b, int64_t e, int64_t r, int rr) {
      group(rr, xw + (r / kGroup) * k * kGroup, kp, w, b, e - b, od + r * n, n);
    });
    return;
  }
  // many rows: one equal share of the 16-column blocks per thread of torch's pool (`--threads`); each block is
  // widened into the thread's buffer a span of K at a time (at most kSpan k: 128 KiB of fp32, which stays in L2
  // while the row groups run on it; a whole K of 8,192 did not, and ran at half the rate at 64 rows), the row
  // groups' partial sums kept in fp32 between spans and rounded once at the end. The rows go kChunk at a time
  // (their widened activations, kChunk x K x 4 bytes, stay in L3 across the column blocks: a 2,048-token step's
  // whole 2,048 x 8,192 for down_proj, 64 MiB, came from memory for every block, 137 against 180 GFLOP/s).
  constexpr int64_t kSpan = 2048, kChunk = 32 * kGroup;
  const int64_t nt = get_num_threads();
  parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = nblk * t / nt, hi = nblk * (t + 1) / nt;
      std::vector<float> wf(static_cast<size_t>(std::min(k, kSpan) * 16));
      auto* cs = static_cast<float*>(std::aligned_alloc(32, kChunk * 16 * sizeof(float)));
      for (int64_t r0 = 0; r0 < m; r0 += kChunk) {
        const int64_t r1 = std::min(m, r0 + kChunk);
        for (int64_t b = lo; b < hi; ++b) {
          std::fill_n(cs, kChunk * 16, 0.0f);
          for (int64_t k0 = 0; k0 < k; k0 += kSpan) {
            const int64_t kc = std::min(kSpan, k - k0);
            widen(w + (b * kp + k0 / 2) * 16, kc / 2, wf.data());
            for (int64_t r = r0; r < r1; r += kGroup)
              rows_f32(static_cast<int>(std::min<int64_t>(kGroup, r1 - r)),
                       xw + (r / kGroup) * k * kGroup + k0 * kGroup, kc, wf.data(), cs + (r - r0) * 16);
          }
          for (int64_t r = r0; r < r1; r += kGroup)
            store_rows_bf16(cs + (r - r0) * 16, static_cast<int>(std::min<int64_t>(kGroup, r1 - r)),
                            od + r * n + b * 16, n);
        }
      }
      std::free(cs);
    }
  });
}
#endif

void register_linear_avx2(Table& t) {
#if CONVEYOR_HAS_AVX2_LINEAR
  t.linear_avx2 = &linear_avx2;
#else
  (void)t;
#endif
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
