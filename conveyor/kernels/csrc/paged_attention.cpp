// Paged attention on the CPU, read straight from the block pool.
//
// One call serves a whole step: decodes, whole prompts and continued prompt chunks alike. Query
// token i of sequence s (rows cu_q[s] .. cu_q[s+1]) sits at position ctx_len[s] - q_len + i and
// attends to keys 0..position of that sequence, found through block_tables[s].
//
// Work is split into items (sequence, KV head, tile of query tokens); the query heads that share a
// KV head (GQA) are processed together, so each K/V element is loaded once per item and reused by
// every row of it. Keys are visited in fixed tiles of KV_TILE positions counted from position 0,
// with an online softmax, so the order of every reduction depends only on the query's own position
// and context: never on the batch it runs in, on how its prompt was chunked, or on the thread count.
//
// K/V may be fp32 or bf16 (the query's dtype), or int8 with one fp16 scale per token and KV head
// (`--kv-cache-dtype int8`): a key's score is its integer dot product times its scale, and a value's
// softmax weight is multiplied by its scale before P.V, so nothing is dequantized into memory.
// Scores, softmax and the accumulator are fp32. The loops are written for
// the compiler's auto-vectoriser (-O3 -march=native): 16 keys per tile map onto one AVX-512 register
// (two AVX2 registers), the head dimension onto the accumulator rows.

#include "kernel_api.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {
namespace {

constexpr int KV_TILE = 16;     // keys per online-softmax step: fixed, part of the numerics
constexpr int MAX_ROWS = 64;    // query rows (tokens x heads of one KV group) per work item
constexpr int MAX_D = 256;
// How many tiles ahead K/V are prefetched, and into L2 (locality 2: prefetcht1), not L1. Measured on a
// 64 x 350-token decode over a 4 GiB pool (AMD EPYC Zen 4, 2 threads, 3 interleaved runs each): into L1,
// 1.08-1.29 ms per layer; into L2, 0.79-0.86 ms, with blocks scattered at random or mostly in order alike
// (L1 prefetches hold the few L1 miss buffers; L2 has many more). 2-4 tiles ahead were no better.
// Taking all KV heads of a decode in one work item (reading each block front to back) measured slower.
#if defined(__AVX512F__)
constexpr int PREFETCH_TILES = 1;
#else
constexpr int PREFETCH_TILES = 3;
#endif


inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float half_to_float(half x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

using conveyor::exp_approx;

#ifdef __AVX512F__
using conveyor::exp16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16_half(const half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One 16-key tile for NR query rows, read straight from the cache: scores (two partial sums over d per
// row, a fixed order), online-softmax update, P.V into the fp32 accumulators, kept in registers for a
// chunk of up to 64 dimensions at a time. kt: the tile's K, [D] rows of `kstride` keys; vt: [16][D];
// ksc/vsc: the 16 keys' and values' scales (int8 caches), else null.
template <typename T, int D, int NR>
inline void tile16(const float (*Q)[D], float (*acc)[D], float* m, float* l, const int* valid, int n,
                   const T* kt, int64_t kstride, const T* vt, const half* ksc, const half* vsc) {
  __m512 sa[NR], sb[NR];
  for (int i = 0; i < NR; ++i) { sa[i] = _mm512_setzero_ps(); sb[i] = _mm512_setzero_ps(); }
  for (int d = 0; d < D; d += 2) {
    const __m512 k0 = load16(kt + d * kstride);
    const __m512 k1 = load16(kt + (d + 1) * kstride);
    for (int i = 0; i < NR; ++i) {
      sa[i] = _mm512_fmadd_ps(_mm512_set1_ps(Q[i][d]), k0, sa[i]);
      sb[i] = _mm512_fmadd_ps(_mm512_set1_ps(Q[i][d + 1]), k1, sb[i]);
    }
  }
  alignas(64) float pr[NR][16];
  float corr[NR];
  constexpr bool quantized = std::is_same<T, int8_t>::value;
  __m512 kscale = _mm512_setzero_ps(), vscale = _mm512_setzero_ps();
  if constexpr (quantized) {
    kscale = load16_half(ksc);
    vscale = load16_half(vsc);
  }
  for (int i = 0; i < NR; ++i) {
    const int vi = std::max(valid[i], 0);
    const __mmask16 mask = static_cast<__mmask16>((1u << vi) - 1u);
    __m512 s = _mm512_add_ps(sa[i], sb[i]);
    if constexpr (quantized) s = _mm512_mul_ps(s, kscale);
    // the running max moves only when a key beats it (rarely, past a prompt's first tiles): else mx = m and
    // corr = exp_approx(0) = 1 exactly, the same bits without the reduction and the scalar exp
    const bool moves = vi > 0 && _mm512_mask_cmp_ps_mask(mask, s, _mm512_set1_ps(m[i]), _CMP_GT_OQ) != 0;
    const float mx = moves ? std::max(m[i], _mm512_mask_reduce_max_ps(mask, s)) : m[i];
    const __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
    corr[i] = moves ? exp_approx(m[i] - mx) : 1.f;
    l[i] = l[i] * corr[i] + _mm512_reduce_add_ps(p);
    m[i] = mx;
    _mm512_store_ps(pr[i], quantized ? _mm512_mul_ps(p, vscale) : p);
  }
  constexpr int CH = D < 64 ? D : 64;  // accumulator chunk: NR x CH/16 registers
  for (int c = 0; c < D; c += CH) {
    const int ch = std::min(CH, D - c);  // 64, or what is left (D = 80, 96): never past the row
    __m512 a[NR][CH / 16];
    for (int i = 0; i < NR; ++i) {
      const __m512 ci = _mm512_set1_ps(corr[i]);
      for (int b = 0; b < ch / 16; ++b) a[i][b] = _mm512_mul_ps(_mm512_load_ps(acc[i] + c + b * 16), ci);
    }
    for (int j = 0; j < n; ++j) {
      for (int b = 0; b < ch / 16; ++b) {
        const __m512 v = load16(vt + j * D + c + b * 16);
        for (int i = 0; i < NR; ++i) a[i][b] = _mm512_fmadd_ps(_mm512_set1_ps(pr[i][j]), v, a[i][b]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      for (int b = 0; b < ch / 16; ++b) _mm512_store_ps(acc[i] + c + b * 16, a[i][b]);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define CONVEYOR_ATTN_AVX2 1
// The AVX2 variant's tile (AMD EPYC Zen 3, say): 16 keys as two 8-lane halves. Without it that variant ran the
// scalar loops below, 5.3 ms per layer for 64 decodes of ~300 tokens on a Zen 3 (as long as all the layer's
// linears together). Scores are two FMA chains over d per key (even, odd; fixed order), so a row's result depends
// only on its own position and context, as everywhere in this file.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8_half(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 8 lanes of exp_approx, the same arithmetic (2^floor built from the exponent bits, as the scalar one does)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hsum8(__m256 v) {  // a fixed tree: (lo + hi), then pairs
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The AVX2 tile works in three passes over an item's rows, where the AVX-512 tile does a register block's scores,
// softmax and P.V in turn: every row's scores, then every row's softmax (independent rows, whose dependent steps
// overlap), then P.V; each pass takes the rows in the register blocks that suit it. The scores: two FMA chains per
// (row, 8 keys), over even and odd d, added at the end (as the AVX-512 tile does), three rows at a time: 12
// accumulators, and per d 2 key loads and 3 broadcasts for 6 FMAs. Two rows a block, as before, took a load per
// FMA, and the loads bound it; one chain per key let four rows fit (8 accumulators) but lost the pairwise sum's
// precision (fp32 logits off HF's by 1.3e-4 at head_dim 32, against 1e-4 allowed). A row's arithmetic is the same
// in any block, so its result depends only on its position and context.
template <typename T, int D, int NR>
inline void scores_avx2(const float (*Q)[D], const T* kt, int64_t kstride, float (*S)[16]) {
  static_assert(NR <= 3, "12 accumulators, 2 keys and a broadcast fill the 16 registers");
  __m256 a[NR][2], b[NR][2];  // even d, odd d
  for (int i = 0; i < NR; ++i) a[i][0] = a[i][1] = b[i][0] = b[i][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 2) {
    {
      const __m256 k0 = load8(kt + d * kstride), k1 = load8(kt + d * kstride + 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 q = _mm256_set1_ps(Q[i][d]);
        a[i][0] = _mm256_fmadd_ps(q, k0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(q, k1, a[i][1]);
      }
    }
    {
      const __m256 k0 = load8(kt + (d + 1) * kstride), k1 = load8(kt + (d + 1) * kstride + 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 q = _mm256_set1_ps(Q[i][d + 1]);
        b[i][0] = _mm256_fmadd_ps(q, k0, b[i][0]);
        b[i][1] = _mm256_fmadd_ps(q, k1, b[i][1]);
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    _mm256_store_ps(S[i], _mm256_add_ps(a[i][0], b[i][0]));
    _mm256_store_ps(S[i] + 8, _mm256_add_ps(a[i][1], b[i][1]));
  }
}

// One row's online-softmax step over its tile's scores S (replaced by the weights, times the values' scales for an
// int8 cache): m updated, and the denominator l8, one partial sum per key lane (k and k + 8), summed across lanes
// once, when the item's output is written (a horizontal sum every tile was 8% of a prompt's attention time); the
// accumulator's correction returned (exactly 1 when the max did not move).
template <bool QUANTIZED>
inline float softmax_row_avx2(float* S, float& m, float* l8, int valid, __m256 ks0, __m256 ks1, __m256 vs0, __m256 vs1) {
  const int vi = std::max(valid, 0);
  const __m256i vv = _mm256_set1_epi32(vi);
  const __m256 m0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vv, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  const __m256 m1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vv, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
  __m256 s0 = _mm256_load_ps(S), s1 = _mm256_load_ps(S + 8);
  if constexpr (QUANTIZED) s0 = _mm256_mul_ps(s0, ks0), s1 = _mm256_mul_ps(s1, ks1);
  // the running max moves only when a key beats it (rarely, past a prompt's first tiles): else mx = m and
  // corr = exp_approx(0) = 1 exactly, the same bits without the reduction and the scalar exp
  const __m256 mold = _mm256_set1_ps(m);
  const bool moves = vi > 0 && (_mm256_movemask_ps(_mm256_and_ps(m0, _mm256_cmp_ps(s0, mold, _CMP_GT_OQ))) |
                                _mm256_movemask_ps(_mm256_and_ps(m1, _mm256_cmp_ps(s1, mold, _CMP_GT_OQ)))) != 0;
  const __m256 neg = _mm256_set1_ps(-INFINITY);
  const float mx = moves ? std::max(m, hmax8(_mm256_max_ps(_mm256_blendv_ps(neg, s0, m0), _mm256_blendv_ps(neg, s1, m1))))
                         : m;
  const __m256 mxv = _mm256_set1_ps(mx);
  const __m256 p0 = _mm256_and_ps(m0, exp8(_mm256_sub_ps(s0, mxv)));  // keys past the row's position: 0
  const __m256 p1 = _mm256_and_ps(m1, exp8(_mm256_sub_ps(s1, mxv)));
  const float corr = moves ? exp_approx(m - mx) : 1.f;
  const __m256 lo = _mm256_load_ps(l8);
  _mm256_store_ps(l8, _mm256_add_ps(moves ? _mm256_mul_ps(lo, _mm256_set1_ps(corr)) : lo, _mm256_add_ps(p0, p1)));
  m = mx;
  _mm256_store_ps(S, QUANTIZED ? _mm256_mul_ps(p0, vs0) : p0);
  _mm256_store_ps(S + 8, QUANTIZED ? _mm256_mul_ps(p1, vs1) : p1);
  return corr;
}

// P.V for NR rows over the tile's first n keys (weights P), into the fp32 accumulators, rescaled first where a
// row's max moved (x * 1 == x: skipped when none did).
template <typename T, int D, int NR>
inline void pv_avx2(const float (*P)[16], const float* corr, float (*acc)[D], const T* vt, int n) {
  bool rescale = false;
  for (int i = 0; i < NR; ++i) rescale |= corr[i] != 1.f;
  constexpr int CH = (NR <= 3 && D % 32 == 0) ? 32 : 16;  // accumulator chunk: NR x CH/8 registers
  for (int c = 0; c < D; c += CH) {
    __m256 a[NR][CH / 8];
    for (int i = 0; i < NR; ++i) {
      const __m256 ci = _mm256_set1_ps(corr[i]);
      for (int b = 0; b < CH / 8; ++b) {
        a[i][b] = _mm256_load_ps(acc[i] + c + b * 8);
        if (rescale) a[i][b] = _mm256_mul_ps(a[i][b], ci);
      }
    }
    for (int j = 0; j < n; ++j) {
      for (int b = 0; b < CH / 8; ++b) {
        const __m256 v = load8(vt + j * D + c + b * 8);
        for (int i = 0; i < NR; ++i) a[i][b] = _mm256_fmadd_ps(_mm256_set1_ps(P[i][j]), v, a[i][b]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int b = 0; b < CH / 8; ++b) _mm256_store_ps(acc[i] + c + b * 8, a[i][b]);
  }
}

// All of an item's rows against one 16-key tile (the keys and values as stored, or widened to fp32 once for all
// the row blocks: the same values, so the same bits): every row's scores (three rows a block), then every row's
// softmax, then P.V (four rows a block). P.V of a block runs over the keys its last row sees (rows are in position
// order); the others' weights there are 0.
template <typename T, int D>
inline void tiles_avx2(const float (*Q)[D], float (*acc)[D], float* m, float (*l8)[8], const int* valid, int rows,
                       const T* kt, int64_t kstride, const T* vt, const half* ksc, const half* vsc) {
  alignas(32) float S[MAX_ROWS][16];
  float corr[MAX_ROWS];
  int r = 0;
  for (; r + 3 <= rows; r += 3) scores_avx2<T, D, 3>(Q + r, kt, kstride, S + r);
  switch (rows - r) {
    case 2: scores_avx2<T, D, 2>(Q + r, kt, kstride, S + r); break;
    case 1: scores_avx2<T, D, 1>(Q + r, kt, kstride, S + r); break;
    default: break;
  }
  constexpr bool quantized = std::is_same<T, int8_t>::value;
  __m256 ks0 = _mm256_setzero_ps(), ks1 = ks0, vs0 = ks0, vs1 = ks0;
  if constexpr (quantized) {
    ks0 = load8_half(ksc), ks1 = load8_half(ksc + 8), vs0 = load8_half(vsc), vs1 = load8_half(vsc + 8);
  }
  for (int i = 0; i < rows; ++i) corr[i] = softmax_row_avx2<quantized>(S[i], m[i], l8[i], valid[i], ks0, ks1, vs0, vs1);
  for (r = 0; r + 4 <= rows; r += 4) pv_avx2<T, D, 4>(S + r, corr + r, acc + r, vt, std::max(valid[r + 3], 0));
  const int nl = std::max(valid[rows - 1], 0);
  switch (rows - r) {
    case 3: pv_avx2<T, D, 3>(S + r, corr + r, acc + r, vt, nl); break;
    case 2: pv_avx2<T, D, 2>(S + r, corr + r, acc + r, vt, nl); break;
    case 1: pv_avx2<T, D, 1>(S + r, corr + r, acc + r, vt, nl); break;
    default: break;
  }
}
#else
#define CONVEYOR_ATTN_AVX2 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define CONVEYOR_ATTN_DPBF16 1
// bf16 caches: the same 16-key tile with the AVX-512 BF16 dot-product instruction (vdpbf16ps), which
// multiplies pairs of bf16 and adds both products to an fp32 lane: no bf16 -> fp32 conversions, half the
// instructions. Q.K^T: the K rows d and d+1 of the tile (16 keys each) become 16 (d, d+1) pairs with one
// word permutation; the query row is read as bf16 pairs, unscaled (the score is scaled afterwards).
// P.V: the softmax weights are rounded to bf16 (as HF's eager attention rounds them to the model dtype
// before its P.V matmul; l keeps the fp32 sum), and values of keys j and j+1 are interleaved with
// unpacklo/hi, so the accumulator lanes hold the head dimensions in a fixed permuted order
// (`acc_lane_of`), put back when the output is written. Every sum still runs in one fixed order: pairs of
// dimensions (two alternating chains) for a score, pairs of keys for an output.
inline int acc_lane_of(int d) {  // where dimension d sits in a permuted accumulator row
  const int base = d & ~31, dd = d & 31, lane = dd >> 3, k = dd & 7;
  return base + (k < 4 ? lane * 4 + k : 16 + lane * 4 + (k - 4));
}

// K of a tile as 16 (d, d + 1) pairs per vector: word 2j <- (row d, key j), 2j + 1 <- (row d + 1, key j).
template <bool PACKED_ROWS>
inline __m512i k_pairs(const uint16_t* kw, int p, int64_t kstride) {
  const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i r;
  if constexpr (PACKED_ROWS) {  // block_size 16: rows d and d + 1 are one 64-byte line
    r = _mm512_loadu_si512(kw + 2 * p * 16);
  } else {
    r = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(kw + 2 * p * kstride))),
                           _mm256_loadu_si256((const __m256i*)(kw + (2 * p + 1) * kstride)), 1);
  }
  return _mm512_permutexvar_epi16(pair_idx, r);
}

// A tile's K pairs and V interleave, made once for all the row blocks of an item (`tiles_dp`): with 8-row
// blocks a 64-row prefill item made them 8 times over, a shuffle for every eight dot products. The same
// vectors, so the same bits. vlo/vhi: for key pair jp and 32 dimensions s, at [jp * (D / 32) + s].
template <int D>
struct TilePrep {
  __m512i k[D / 2];
  __m512i vlo[8 * (D / 32)], vhi[8 * (D / 32)];
  int n = 0;  // the keys it was made for: a key pair past them holds zeros in its second key, as tile16_dp's own
};

// Q.K of one block of NR rows against the tile: the scaled scores, one vector a row.
template <int D, int NR, bool PACKED_ROWS>
inline void scores_dp(const uint32_t (*Qp)[D / 2], __m512 (&s)[NR], const bf16* kt, int64_t kstride, float scale,
                      const TilePrep<D>* prep) {
  static_assert(D % 32 == 0, "the bf16 tile takes head dims in multiples of 32");
  __m512 sa[NR], sb[NR];
  for (int i = 0; i < NR; ++i) { sa[i] = _mm512_setzero_ps(); sb[i] = _mm512_setzero_ps(); }
  const uint16_t* kw = reinterpret_cast<const uint16_t*>(kt);
  for (int p = 0; p < D / 2; p += 2) {
    const __m512bh k0 = (__m512bh)(prep ? prep->k[p] : k_pairs<PACKED_ROWS>(kw, p, kstride));
    const __m512bh k1 = (__m512bh)(prep ? prep->k[p + 1] : k_pairs<PACKED_ROWS>(kw, p + 1, kstride));
    for (int i = 0; i < NR; ++i) {
      sa[i] = _mm512_dpbf16_ps(sa[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(Qp[i][p])), k0);
      sb[i] = _mm512_dpbf16_ps(sb[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(Qp[i][p + 1])), k1);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int i = 0; i < NR; ++i) s[i] = _mm512_mul_ps(_mm512_add_ps(sa[i], sb[i]), vscale);
}

// The online softmax of one row over the tile: its running max m and per-key-lane sums lv move on, its weights
// go out as bf16 pairs (keys 2j, 2j + 1) in pw, and corr is the factor its accumulator takes (exactly 1, and
// false returned, when the max did not move: x * 1 == x, so the accumulator is left as it is).
__attribute__((always_inline)) inline bool softmax_dp(__m512 s, float& m, float* lv, int valid, uint32_t* pw, float& corr) {
  const int vi = std::max(valid, 0);
  const __mmask16 mask = static_cast<__mmask16>((1u << vi) - 1u);
  const bool moves = vi > 0 && _mm512_mask_cmp_ps_mask(mask, s, _mm512_set1_ps(m), _CMP_GT_OQ) != 0;  // (tile16)
  const float mx = moves ? std::max(m, _mm512_mask_reduce_max_ps(mask, s)) : m;
  const __m512 pr = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
  corr = moves ? exp_approx(m - mx) : 1.f;
  const __m512 lo = _mm512_load_ps(lv);  // l per key lane: summed across lanes once, at the item's end
  _mm512_store_ps(lv, _mm512_add_ps(moves ? _mm512_mul_ps(lo, _mm512_set1_ps(corr)) : lo, pr));
  m = mx;
  _mm256_store_si256(reinterpret_cast<__m256i*>(pw), (__m256i)_mm512_cvtneps_pbh(pr));
  return moves;
}

// P.V of one block of NR rows over the tile's first n keys (the keys its last row sees: the others' weights
// there are 0); `rescale`: whether any row's max moved (else every corr is 1).
template <int D, int NR, bool PACKED_ROWS>
inline void pv_dp(const uint32_t (*pw)[8], const float* corr, bool rescale, float (*acc)[D], int n, const bf16* vt,
                  const TilePrep<D>* prep) {
  const uint16_t* vw = reinterpret_cast<const uint16_t*>(vt);
  const int pairs = (n + 1) / 2;
  // accumulator chunk: NR x CH/16 registers (above 4 rows, 32 dims a chunk keep them in the 32 zmm; the V
  // interleave is done once per 32 dims either way)
  constexpr int CH = NR > 4 ? 32 : (D < 64 ? D : 64);
  for (int c = 0; c < D; c += CH) {
    const int ch = std::min(CH, D - c);  // 64, or a last 32 (D = 96)
    __m512 a[NR][CH / 16];
    for (int i = 0; i < NR; ++i) {
      const __m512 ci = _mm512_set1_ps(corr[i]);
      for (int b = 0; b < ch / 16; ++b) {
        a[i][b] = _mm512_load_ps(acc[i] + c + b * 16);
        if (rescale) a[i][b] = _mm512_mul_ps(a[i][b], ci);  // x * 1 == x: skipped when no max moved
      }
    }
    for (int jp = 0; jp < pairs; ++jp) {
      const int j = 2 * jp;
      const bool second = j + 1 < n;  // an odd last key pairs with zeros, never with an unwritten slot
      const bool prepared = prep && (second || j + 1 >= prep->n);  // (else its second key is not zero there)
      for (int sc = 0; sc < ch / 32; ++sc) {
        __m512bh lo, hi;
        if (prepared) {
          lo = (__m512bh)prep->vlo[jp * (D / 32) + c / 32 + sc];
          hi = (__m512bh)prep->vhi[jp * (D / 32) + c / 32 + sc];
        } else {
          const __m512i v0 = _mm512_loadu_si512(vw + j * D + c + sc * 32);
          const __m512i v1 = second ? _mm512_loadu_si512(vw + (j + 1) * D + c + sc * 32) : _mm512_setzero_si512();
          lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
          hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        }
        for (int i = 0; i < NR; ++i) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[i][jp]));
          a[i][2 * sc] = _mm512_dpbf16_ps(a[i][2 * sc], w, lo);
          a[i][2 * sc + 1] = _mm512_dpbf16_ps(a[i][2 * sc + 1], w, hi);
        }
      }
    }
    for (int i = 0; i < NR; ++i) {
      for (int b = 0; b < ch / 16; ++b) _mm512_store_ps(acc[i] + c + b * 16, a[i][b]);
    }
  }
}

// A lone block of NR rows (a decode: a GQA group of 7 heads, Qwen2.5-0.5B's, is one block; 4-row blocks made it
// two) in one pass: scores, softmax and P.V with the scores in registers, permuting the tile's K and interleaving
// its V itself.
template <int D, int NR, bool PACKED_ROWS>
inline void tile16_dp(const uint32_t (*Qp)[D / 2], float (*acc)[D], float* m, float (*lv)[16], const int* valid, int n,
                      const bf16* kt, int64_t kstride, const bf16* vt, float scale) {
  __m512 s[NR];
  scores_dp<D, NR, PACKED_ROWS>(Qp, s, kt, kstride, scale, nullptr);
  alignas(64) uint32_t pw[NR][8];  // the weights as bf16 pairs (keys 2j, 2j + 1)
  float corr[NR];
  bool rescale = false;  // whether any row's max moved (else every corr is 1: the accumulators stay as they are)
  for (int i = 0; i < NR; ++i) rescale |= softmax_dp(s[i], m[i], lv[i], valid[i], pw[i], corr[i]);
  pv_dp<D, NR, PACKED_ROWS>(pw, corr, rescale, acc, n, vt, nullptr);
}

// Calls f(std::integral_constant<int, n>{}) for a row count n of 1 to 8 known only at run time: the row-block
// kernels take theirs as a template parameter, since their accumulators are arrays of registers.
template <typename F>
__attribute__((always_inline)) inline void with_rows(int n, F&& f) {
  switch (n) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// One tile for all rows of an item. Up to 8 rows: one block (`tile16_dp`). More (a prompt's tile of tokens): K
// permuted and V interleaved once for all of them (`TilePrep`), then three passes: every row's scores (blocks
// of 8 rows), every row's softmax, P.V (blocks of 4 rows: a block of 4 rows x 64 dimensions uses each weight's
// broadcast for four dot products; 8 x 32 ran at 134 GFLOP/s a Zen 4 core against 209, L1-resident). Each row
// gets the same operations in the same order whatever its block, so the same bits.
template <int D, bool PACKED_ROWS>
inline void tiles_dp(const uint32_t (*Qp)[D / 2], float (*acc)[D], float* m, float (*l)[16], const int* valid, int rows,
                     const bf16* kt, int64_t kstride, const bf16* vt, float scale) {
  const int nl = std::max(valid[rows - 1], 0);  // rows are in position order: the last sees the most keys
  if (rows <= 8) {
    with_rows(rows, [&](auto nr) {
      tile16_dp<D, decltype(nr)::value, PACKED_ROWS>(Qp, acc, m, l, valid, nl, kt, kstride, vt, scale);
    });
    return;
  }
  alignas(64) TilePrep<D> tp;
  const uint16_t* kw = reinterpret_cast<const uint16_t*>(kt);
  const uint16_t* vw = reinterpret_cast<const uint16_t*>(vt);
  for (int p = 0; p < D / 2; ++p) tp.k[p] = k_pairs<PACKED_ROWS>(kw, p, kstride);
  for (int jp = 0; jp < (nl + 1) / 2; ++jp) {
    const int j = 2 * jp;
    for (int s = 0; s < D / 32; ++s) {
      const __m512i v0 = _mm512_loadu_si512(vw + j * D + s * 32);
      const __m512i v1 = j + 1 < nl ? _mm512_loadu_si512(vw + (j + 1) * D + s * 32) : _mm512_setzero_si512();
      tp.vlo[jp * (D / 32) + s] = _mm512_unpacklo_epi16(v0, v1);
      tp.vhi[jp * (D / 32) + s] = _mm512_unpackhi_epi16(v0, v1);
    }
  }
  tp.n = nl;
  alignas(64) float S[MAX_ROWS][16];
  alignas(64) uint32_t pw[MAX_ROWS][8];  // the weights as bf16 pairs (keys 2j, 2j + 1)
  float corr[MAX_ROWS];
  bool moved[MAX_ROWS];
  auto scores = [&](int r, auto nr) {  // rows r .. r + NR - 1
    constexpr int NR = decltype(nr)::value;
    __m512 s[NR];
    scores_dp<D, NR, PACKED_ROWS>(Qp + r, s, kt, kstride, scale, &tp);
    for (int i = 0; i < NR; ++i) _mm512_store_ps(S[r + i], s[i]);
  };
  const int octs = rows & ~7;
  for (int r = 0; r < octs; r += 8) scores(r, std::integral_constant<int, 8>{});
  with_rows(rows - octs, [&](auto nr) { scores(octs, nr); });
  for (int i = 0; i < rows; ++i) moved[i] = softmax_dp(_mm512_load_ps(S[i]), m[i], l[i], valid[i], pw[i], corr[i]);
  auto pv = [&](int r, auto nr) {  // rows r .. r + NR - 1, over the keys the last of them sees
    constexpr int NR = decltype(nr)::value;
    bool rescale = false;
    for (int i = r; i < r + NR; ++i) rescale |= moved[i];
    pv_dp<D, NR, PACKED_ROWS>(pw + r, corr + r, rescale, acc + r, std::max(valid[r + NR - 1], 0), vt, &tp);
  };
  const int quads = rows & ~3;
  for (int r = 0; r < quads; r += 4) pv(r, std::integral_constant<int, 4>{});
  with_rows(rows - quads, [&](auto nr) { pv(quads, nr); });
}
#else
#define CONVEYOR_ATTN_DPBF16 0
#endif

template <typename T, typename CT, int D>
void attend_item(const T* __restrict q, T* __restrict out, const CT* __restrict k_cache, const CT* __restrict v_cache,
                 const half* __restrict k_scale, const half* __restrict v_scale,
                 const int32_t* __restrict table, int64_t q_begin, int64_t q_end, int64_t first_pos, int head0,
                 int group, int64_t q_stride_t, int64_t block_size, int64_t block_stride, int kvh, float scale) {
  const int64_t nt = q_end - q_begin;
  const int rows = static_cast<int>(nt) * group;
  const int tile = static_cast<int>(std::min<int64_t>(KV_TILE, block_size));
  alignas(64) float Q[MAX_ROWS][D];
  alignas(64) float acc[MAX_ROWS][D];
  alignas(64) float Kt[D][KV_TILE];
  alignas(64) float V[KV_TILE][D];
  float m[MAX_ROWS], l[MAX_ROWS];
  int64_t pos[MAX_ROWS];
#if CONVEYOR_ATTN_DPBF16
  constexpr bool dp = std::is_same<CT, bf16>::value && std::is_same<T, bf16>::value && D % 32 == 0;
  const bool use_dp = dp && tile == 16;
  alignas(64) uint32_t Qp[dp ? MAX_ROWS : 1][D / 2];  // the bf16 query rows as (d, d + 1) pairs, unscaled
  alignas(64) float lv[dp ? MAX_ROWS : 1][16];        // the softmax denominators, one partial sum per key lane
  if (use_dp) std::memset(lv, 0, sizeof(float) * 16 * rows);
#else
  const bool use_dp = false;
#endif
#if CONVEYOR_ATTN_AVX2
  // Whether the AVX2 tile runs (whole 16-key tiles, whole 16-dimension chunks): the one place that decides, since it
  // also decides where the denominators live (the tile keeps one partial sum per key lane in l8, not l).
  const bool avx2_tile = tile == 16 && D % 16 == 0;
  alignas(32) float l8[MAX_ROWS][8];
  if (avx2_tile) std::memset(l8, 0, sizeof(float) * 8 * rows);
#endif
  for (int r = 0; r < rows; ++r) {
    const int64_t t = q_begin + r / group;
    const int h = head0 + r % group;
    const T* src = q + t * q_stride_t + h * D;
#if CONVEYOR_ATTN_DPBF16
    if (use_dp)  // the dot-product tile reads the bf16 pairs as they are (and never Q or Kt)
      std::memcpy(Qp[r], src, D * sizeof(T));
    else
#endif
      for (int d = 0; d < D; ++d) Q[r][d] = to_float(src[d]) * scale;
    for (int d = 0; d < D; ++d) acc[r][d] = 0.f;
    m[r] = -1e30f;
    l[r] = 0.f;
    pos[r] = first_pos + r / group;
  }
  if (!use_dp)
    for (int j = 0; j < KV_TILE; ++j) {
      for (int d = 0; d < D; ++d) Kt[d][j] = 0.f;
    }
  const int64_t last = pos[rows - 1];  // rows are in position order: the last one sees the most keys
  const int64_t head_off = static_cast<int64_t>(kvh) * D * block_size;
  for (int64_t k0 = 0; k0 <= last; k0 += tile) {
    const int n = static_cast<int>(std::min<int64_t>(tile, last + 1 - k0));
    const int64_t base = static_cast<int64_t>(table[k0 / block_size]) * block_stride + head_off;
    const int64_t off = k0 % block_size;
    const CT* ks = k_cache + base + off;      // K block is [D][block_size]: the tile's keys are contiguous per d
    const CT* vs = v_cache + base + off * D;  // V block is [block_size][D]
    // scales (int8 caches): [blocks, Hkv, block_size], one per token and head
    const int64_t sbase = (static_cast<int64_t>(table[k0 / block_size]) * (block_stride / (D * block_size)) + kvh) *
                          block_size + off;
    const half* ksc = k_scale ? k_scale + sbase : nullptr;
    const half* vsc = v_scale ? v_scale + sbase : nullptr;
    if (k0 + PREFETCH_TILES * tile <= last) {  // tiles ahead sit in other blocks: start loading them now
      const int64_t k1 = k0 + PREFETCH_TILES * tile;
      const int64_t nb = static_cast<int64_t>(table[k1 / block_size]) * block_stride + head_off;
      const char* nk = reinterpret_cast<const char*>(k_cache + nb + k1 % block_size);
      const char* nv = reinterpret_cast<const char*>(v_cache + nb + (k1 % block_size) * D);
      const int64_t krow = block_size * static_cast<int64_t>(sizeof(CT));
      const int step = krow * 2 <= 64 ? static_cast<int>(64 / krow) : 1;  // rows that share a cache line
      for (int d = 0; d < D; d += step) __builtin_prefetch(nk + d * krow, 0, 2);
      for (int64_t b = 0; b < static_cast<int64_t>(tile * D * sizeof(CT)); b += 64) __builtin_prefetch(nv + b, 0, 2);
    }
#if CONVEYOR_ATTN_DPBF16
    if constexpr (dp) {
      if (use_dp) {
        int valid[MAX_ROWS];
        for (int r = 0; r < rows; ++r) valid[r] = static_cast<int>(std::min<int64_t>(n, pos[r] + 1 - k0));
        const bf16* kb = reinterpret_cast<const bf16*>(ks);
        const bf16* vb = reinterpret_cast<const bf16*>(vs);
        if (block_size == 16) {
          tiles_dp<D, true>(Qp, acc, m, lv, valid, rows, kb, block_size, vb, scale);
        } else {
          tiles_dp<D, false>(Qp, acc, m, lv, valid, rows, kb, block_size, vb, scale);
        }
        continue;
      }
    }
#endif
#ifdef __AVX512F__
    if (tile == 16 && D % 16 == 0) {
      int valid[MAX_ROWS];
      for (int r = 0; r < rows; ++r) valid[r] = static_cast<int>(std::min<int64_t>(n, pos[r] + 1 - k0));
      int r = 0;
      for (; r + 4 <= rows; r += 4) {
        tile16<CT, D, 4>(Q + r, acc + r, m + r, l + r, valid + r, std::max(valid[r + 3], 0), ks, block_size, vs,
                         ksc, vsc);
      }
      const int nl = std::max(valid[rows - 1], 0);
      switch (rows - r) {
        case 3: tile16<CT, D, 3>(Q + r, acc + r, m + r, l + r, valid + r, nl, ks, block_size, vs, ksc, vsc); break;
        case 2: tile16<CT, D, 2>(Q + r, acc + r, m + r, l + r, valid + r, nl, ks, block_size, vs, ksc, vsc); break;
        case 1: tile16<CT, D, 1>(Q + r, acc + r, m + r, l + r, valid + r, nl, ks, block_size, vs, ksc, vsc); break;
        default: break;
      }
      continue;
    }
#endif
#if CONVEYOR_ATTN_AVX2
    if (avx2_tile) {
      int valid[MAX_ROWS];
      for (int r = 0; r < rows; ++r) valid[r] = static_cast<int>(std::min<int64_t>(n, pos[r] + 1 - k0));
      if constexpr (std::is_same<CT, bf16>::value) {
        if (rows > 4) {  // a prompt's rows: widen the tile's keys and values to fp32 once for all row blocks
          for (int d = 0; d < D; ++d) {
            _mm256_store_ps(Kt[d], load8(ks + d * block_size));
            _mm256_store_ps(Kt[d] + 8, load8(ks + d * block_size + 8));
          }
          for (int j = 0; j < n; ++j)
            for (int d = 0; d < D; d += 8) _mm256_store_ps(V[j] + d, load8(vs + j * D + d));
          tiles_avx2<float, D>(Q, acc, m, l8, valid, rows, &Kt[0][0], KV_TILE, &V[0][0], nullptr, nullptr);
          continue;
        }
      }
      tiles_avx2<CT, D>(Q, acc, m, l8, valid, rows, ks, block_size, vs, ksc, vsc);
      continue;
    }
#endif
    for (int d = 0; d < D; ++d) {
      const CT* kd = ks + d * block_size;
      for (int j = 0; j < n; ++j) Kt[d][j] = to_float(kd[j]);
    }
    for (int j = 0; j < n; ++j) {
      for (int d = 0; d < D; ++d) V[j][d] = to_float(vs[j * D + d]);
    }
    alignas(64) float kscale[KV_TILE], vscale[KV_TILE];  // int8: per key; the scores/weights are scaled
    for (int j = 0; j < KV_TILE; ++j) {
      kscale[j] = (ksc && j < n) ? half_to_float(ksc[j]) : 1.f;
      vscale[j] = (vsc && j < n) ? half_to_float(vsc[j]) : 1.f;
    }
    for (int r = 0; r < rows; ++r) {
      const int valid = static_cast<int>(std::min<int64_t>(n, pos[r] + 1 - k0));
      if (valid <= 0) continue;
      // scores of this row against the tile: 4 independent partial sums over d, then a fixed tree
      alignas(64) float s0[KV_TILE] = {0}, s1[KV_TILE] = {0}, s2[KV_TILE] = {0}, s3[KV_TILE] = {0};
      const float* qr = Q[r];
      for (int d = 0; d < D; d += 4) {
        for (int j = 0; j < KV_TILE; ++j) {
          s0[j] += qr[d] * Kt[d][j];
          s1[j] += qr[d + 1] * Kt[d + 1][j];
          s2[j] += qr[d + 2] * Kt[d + 2][j];
          s3[j] += qr[d + 3] * Kt[d + 3][j];
        }
      }
      alignas(64) float s[KV_TILE];
      for (int j = 0; j < KV_TILE; ++j) s[j] = ((s0[j] + s1[j]) + (s2[j] + s3[j])) * kscale[j];
      float mx = m[r];
      for (int j = 0; j < valid; ++j) mx = std::max(mx, s[j]);
      alignas(64) float pr[KV_TILE];
      for (int j = 0; j < KV_TILE; ++j) pr[j] = exp_approx(s[j] - mx);
      const float corr = exp_approx(m[r] - mx);
      float psum = 0.f;
      for (int j = 0; j < valid; ++j) psum += pr[j];
      l[r] = l[r] * corr + psum;
      m[r] = mx;
      float* a = acc[r];
      for (int d = 0; d < D; ++d) a[d] *= corr;
      for (int j = 0; j < valid; ++j) {
        const float pj = pr[j] * vscale[j];
        for (int d = 0; d < D; ++d) a[d] += pj * V[j][d];
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t t = q_begin + r / group;
    const int h = head0 + r % group;
    T* dst = out + t * q_stride_t + h * D;
#if CONVEYOR_ATTN_AVX2
    const float inv = 1.f / (avx2_tile ? hsum8(_mm256_load_ps(l8[r])) : l[r]);
#else
    const float inv = 1.f / l[r];
#endif
#if CONVEYOR_ATTN_DPBF16
    if (use_dp) {  // the accumulator's lanes hold the dimensions permuted; l is one sum per key lane
      const float invl = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(lv[r]));
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r][acc_lane_of(d)] * invl);
      continue;
    }
#endif
    for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r][d] * inv);
  }
}

template <typename T, typename CT, int D>
void run(const AttentionArgs& a) {
  const int64_t num_seqs = a.num_seqs;
  const int64_t heads = a.heads;
  const int64_t kv_heads = a.kv_heads, block_size = a.block_size;
  const int group = static_cast<int>(heads / kv_heads);
  const int64_t tile_tokens = std::max<int64_t>(1, MAX_ROWS / group);
  const int32_t* cu = a.cu_q;
  const int32_t* ctx = a.ctx_lens;
  const int32_t* tables = a.block_tables;
  const int64_t table_stride = a.table_stride;
  // items: (seq, kv head, tile of query tokens); long prompts split into tiles so threads share them
  struct Item { int32_t seq, kvh; int64_t q0, q1; };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t t0 = cu[s]; t0 < cu[s + 1]; t0 += tile_tokens) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), t0,
                         std::min<int64_t>(t0 + tile_tokens, cu[s + 1])});
      }
    }
  }
  const T* qp = static_cast<const T*>(a.q);
  T* op = static_cast<T*>(a.out);
  const CT* kp = static_cast<const CT*>(a.k_cache);
  const CT* vp = static_cast<const CT*>(a.v_cache);
  const half* ksp = a.k_scale;
  const half* vsp = a.v_scale;
  const int64_t q_stride_t = a.q_stride_t;
  const int64_t block_stride = a.block_stride;
  const float scale = a.scale;
  // Items go out largest first (query tokens x keys), one at a time from a shared counter. Why: items differ
  // by 10-100x (a decode of 130 keys beside a 21-token tile deep in a prompt), and the static halves of a
  // parallel_for left one thread waiting: a step of 60 decodes and a 256-token prompt took 1.25 ms per
  // SmolLM2 layer, now ~0.92 (benchmarks/step_kernels.py, 2-core AMD EPYC Zen 4). Which thread runs an item
  // never changes its result.
  auto first_pos = [&](const Item& it) {  // the position of the item's first query token
    return ctx[it.seq] - (cu[it.seq + 1] - cu[it.seq]) + (it.q0 - cu[it.seq]);
  };
  auto cost = [&](const Item& it) { return (it.q1 - it.q0) * (first_pos(it) + it.q1 - it.q0); };  // x keys
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  parallel_for(0, get_num_threads(), 1, [&](int64_t, int64_t) {  // every chunk drains the same counter
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      const Item& it = items[i];
      attend_item<T, CT, D>(qp, op, kp, vp, ksp, vsp, tables + it.seq * table_stride, it.q0, it.q1, first_pos(it),
                            it.kvh * group, group, q_stride_t, block_size, block_stride, it.kvh, scale);
    }
  });
}

// Scatter this step's K/V [T, Hkv, D] into their slots. CT == T: copied as they are. CT == int8_t:
// quantized per token and head, scale = max|x| / 127 rounded to fp16 (one step up where that rounded it
// down, as quantize_kv in attention.py explains) and q = round(x / scale), the
// scales stored beside ([blocks, Hkv, block_size]).
template <typename T, typename CT>
void write_kv(const WriteKVArgs& a) {
  const int64_t n = a.n, hkv = a.kv_heads, d = a.head_dim, bs = a.block_size;
  const int64_t bstride = a.block_stride;
  const int64_t* sl = a.slots;
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  CT* kc = static_cast<CT*>(a.k_cache);
  CT* vc = static_cast<CT*>(a.v_cache);
  half* ksc = a.k_scale;
  half* vsc = a.v_scale;
  const int64_t ks0 = a.k_stride0, ks1 = a.k_stride1, vs0 = a.v_stride0, vs1 = a.v_stride1;
  auto store = [d](const T* src, CT* dst, int64_t dst_stride, half* scale_out) {
    if constexpr (std::is_same<CT, int8_t>::value) {
      float amax = 0.f;
      for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_float(src[i])));
      half sh = static_cast<half>(amax / 127.f);
      if (static_cast<float>(sh) * 127.f < amax) sh.x += 1;  // rounded down: one fp16 step up, so none clamps
      const float sc = static_cast<float>(sh);
      *scale_out = sh;
      for (int64_t i = 0; i < d; ++i) {
        const float qv = sc > 0.f ? std::nearbyint(to_float(src[i]) / sc) : 0.f;
        dst[i * dst_stride] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, qv)));
      }
    } else {
      for (int64_t i = 0; i < d; ++i) dst[i * dst_stride] = src[i];
    }
  };
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t blk = sl[t] / bs, off = sl[t] % bs;
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t si = (blk * hkv + h) * bs + off;
        store(kp + t * ks0 + h * ks1, kc + blk * bstride + h * d * bs + off, bs, ksc ? ksc + si : nullptr);
        store(vp + t * vs0 + h * vs1, vc + blk * bstride + (h * bs + off) * d, 1, vsc ? vsc + si : nullptr);
      }
    }
  });
}

// head_dim: one of KERNEL_HEAD_DIMS (conveyor/model/attention.py); the bindings check it.
template <typename T, typename CT>
void dispatch_d(const AttentionArgs& a) {
  switch (a.head_dim) {
    case 64: return run<T, CT, 64>(a);
    case 128: return run<T, CT, 128>(a);
    case 80: return run<T, CT, 80>(a);
    case 96: return run<T, CT, 96>(a);
    case 32: return run<T, CT, 32>(a);
    case 256: return run<T, CT, 256>(a);
    default: return;
  }
}

// out, q: [T, H, D] contiguous; k_cache: [blocks, Hkv, D, block_size] (K transposed within a block, so a
// tile of keys is contiguous for every d); v_cache: [blocks, Hkv, block_size, D]; dtypes checked by the caller.
void paged_attention(const AttentionArgs& a) {
  const bool q8 = a.cache_dtype == DType::I8;
  if (a.dtype == DType::F32) {
    if (q8) dispatch_d<float, int8_t>(a);
    else dispatch_d<float, float>(a);
  } else {
    if (q8) dispatch_d<bf16, int8_t>(a);
    else dispatch_d<bf16, bf16>(a);
  }
}

void write_kv_cache(const WriteKVArgs& a) {
  const bool q8 = a.cache_dtype == DType::I8;
  if (a.dtype == DType::F32) {
    if (q8) write_kv<float, int8_t>(a);
    else write_kv<float, float>(a);
  } else {
    if (q8) write_kv<bf16, int8_t>(a);
    else write_kv<bf16, bf16>(a);
  }
}

}  // namespace

void register_paged_attention(Table& t) {
  t.paged_attention = &paged_attention;
  t.write_kv_cache = &write_kv_cache;
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
