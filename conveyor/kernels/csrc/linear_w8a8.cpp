// W8A8 int8 linear layers (`--quantization int8_per_channel`): int8 weights with one scale per output channel,
// activations quantized to int8 per token on the fly, int8 dot products summed exactly in int32, then one fp32
// scaling and one rounding to the output dtype.
//
// Why: at 64 rows and in prefill the linear layers are compute-bound, and vpdpbusd multiplies 64 byte pairs per
// instruction where vdpbf16ps multiplies 32 bf16 pairs, at the same instruction rate (measured on the 2-core
// Zen 5 we use: ~7 G instructions/s per core for either). Half the weight bytes also halve a decode step's reads.
//
// Numerics (w8a8_reference in conveyor/model/quantization.py is the same arithmetic in torch):
//   per row r:  a = max_k |x[r,k]| in fp32, at least 1e-30;  inv = 127 / a;  sx[r] = a / 127;
//               xq[r,k] = round-half-even(x[r,k] * inv), so |xq| <= 127 (symmetric: no zero point);
//               a row holding a NaN or an infinity gets sx = NaN and xq = 0, so its outputs are NaN, as the bf16
//               path's would be non-finite (the engine's non-finite check still sees it);
//   y[r,n] = float(sum_k xq[r,k] * q[n,k]) * (sx[r] * sw[n]), rounded once (round to nearest even).
// The sum is exact in int32 (|sum| <= 127 * 127 * K < 2^31 for any K below 133,000), so its order cannot matter:
// row blocking, column blocking, the thread split and the instruction set never change a bit. A row's result is
// the same alone or among any others (batch-invariant by construction), on every variant that runs this file
// and in the torch reference.
//
// Weight layout (packed once at load by pack_w8a8 in quantization.py): int8 [N/16][Kp/4][16][4], Kp = K rounded
// up to a multiple of 4 with zeros: per block of 16 output columns, per group of 4 k, the 16 columns' 4 bytes as
// one 64-byte vector, which is the operand vpdpbusd takes (16 such groups are also one AMX-INT8 B tile).
// comp int32 [N] = 128 * sum_k q[n,k] and sw fp32 [N] come with it.
//
// AVX-512 VNNI (vpdpbusd: unsigned bytes times signed bytes): activations go in as xq + 128 (0..255) and the
// per-column constant comp is subtracted at the end: sum (xq + 128) q = sum xq q + 128 sum q.
// AVX2 without VNNI (AMD Zen 3, Intel to Ice Lake's desktop parts): vpmaddubsw multiplies u8 by s8 into s16
// pairs *with saturation*, which xq + 128 would reach (2 x 255 x 127 > 32767); so instead |q| times xq with q's
// sign (vpsignb), at most 2 x 127 x 127 = 32,258 a pair: exact, no compensation; vpmaddwd by ones then sums pairs
// into int32 lanes. The sign goes onto the activations, not the weights: |q| is then taken once per weight vector
// for all the tile's rows, and each row costs one vpsignb per vector instead of two for |xq| and xq's sign on q.
// AMX-INT8 (Intel Xeon from Sapphire Rapids on; linear_w8a8_amx below): this layout is exactly its B tile (16
// groups of 4 k by 16 columns, 64 bytes a tile row), and tdpbusd is vpdpbusd's arithmetic on 16 x 64 x 16 at once:
// the same u8 x s8 products summed exactly in int32, the same compensation and epilogue, so the same bits.

#include "kernel_api.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CONVEYOR_W8A8 1  // VNNI
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include "amx_tiles.h"
#define CONVEYOR_W8A8_AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_W8A8 2  // AVX2: vpmaddubsw with the sign trick
#else
#define CONVEYOR_W8A8 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

#if CONVEYOR_W8A8
namespace {

constexpr float kMinAbsMax = 1e-30f;  // a row of zeros (or nearly) quantizes to zeros, not to NaN

inline int64_t padded_k(int64_t k) { return (k + 3) / 4 * 4; }

// The stages across vectors, h = h0, 2 h0, ..., b/2 (h0 the vector width): two at a time where two are left (four
// vectors loaded, both stages, four stored: the same pairs and operations as one stage after the other).
template <typename V, typename Load, typename Store, typename Add, typename Sub>
inline void fwht_across(float* x, int64_t k, int64_t b, int64_t h0, Load load, Store store, Add add, Sub sub) {
  int64_t h = h0;
  int stages = 0;
  for (int64_t t = h0; t < b; t *= 2) ++stages;
  if (stages % 2) {
    for (int64_t i = 0; i < k; i += 2 * h)
      for (int64_t j = i; j < i + h; j += h0) {
        const V a = load(x + j), c = load(x + j + h);
        store(x + j, add(a, c));
        store(x + j + h, sub(a, c));
      }
    h *= 2;
  }
  for (; h < b; h *= 4)
    for (int64_t i = 0; i < k; i += 4 * h)
      for (int64_t j = i; j < i + h; j += h0) {
        const V v0 = load(x + j), v1 = load(x + j + h), v2 = load(x + j + 2 * h), v3 = load(x + j + 3 * h);
        const V a0 = add(v0, v1), a1 = sub(v0, v1), a2 = add(v2, v3), a3 = sub(v2, v3);  // stage h
        store(x + j, add(a0, a2));  // stage 2h
        store(x + j + 2 * h, sub(a0, a2));
        store(x + j + h, add(a1, a3));
        store(x + j + 3 * h, sub(a1, a3));
      }
}

// Bytes of scratch, 64-byte aligned (operator new[] of a struct with alignas(64) would do too; this is plainer).
struct Scratch {
  std::unique_ptr<uint8_t[]> raw;
  uint8_t* p = nullptr;
  explicit Scratch(size_t bytes) : raw(new uint8_t[bytes + 64]) {
    p = raw.get() + (64 - reinterpret_cast<uintptr_t>(raw.get()) % 64) % 64;
  }
};

#if CONVEYOR_W8A8 == 1
// ---------------------------------------------------------------------------------------------- AVX-512 VNNI

// 16 values of x from element i (fp32 or bf16), lanes beyond `mask` zero.
inline __m512 load16(DType dt, const void* x, int64_t i, __mmask16 mask) {
  if (dt == DType::BF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(x) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(x) + i);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// One row: k values of x (in dt) -> kp bytes of xq + offset (0: signed bytes; 128: VNNI's unsigned ones); the
// padding bytes hold the offset (xq = 0). Returns sx.
float quantize_row(DType dt, const void* x, int64_t k, int64_t kp, uint8_t* out, int offset) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 mx = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = tail_mask(k - i);
    const __m512 a = _mm512_and_ps(load16(dt, x, i, m), abs_mask);
    bad |= _mm512_mask_cmp_ps_mask(m, a, inf, _CMP_NLT_UQ);  // NaN or infinity
    mx = _mm512_max_ps(mx, a);
  }
  if (bad) {
    std::memset(out, offset, static_cast<size_t>(kp));
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float amax = std::max(_mm512_reduce_max_ps(mx), kMinAbsMax);
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(offset);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = tail_mask(k - i);
    // the product rounded to fp32, then to the nearest integer, ties to even (MXCSR's default, as torch.round)
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(dt, x, i, m), inv));
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);  // |q| <= 127 already; a guard
    _mm_mask_storeu_epi8(out + i, m, _mm512_cvtepi32_epi8(q));
  }
  std::memset(out + k, offset, static_cast<size_t>(kp - k));
  return amax / 127.0f;
}

// Every block of b values of row x [k] (fp32 or bf16), into out [k] fp32 (b a power of two >= 16, k % b == 0): the
// unnormalized Walsh-Hadamard transform, as stages h = 1, 2, 4, ..., b/2, each turning every pair
// (x[i], x[i + h]) (bit h of i clear) into (x[i] + x[i + h], x[i] - x[i + h]) in fp32: w8a8.py's fwht does the
// same operations on the same pairs, so the same bits.
void fwht(DType dt, const void* x, int64_t k, int64_t b, float* out) {
  const __m512i p1 = _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  const __m512i p2 = _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const __m512i p4 = _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  const __m512i p8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t i = 0; i < k; i += 16) {  // stages 1..8, inside each vector: lanes with bit h set take t - v
    __m512 v = load16(dt, x, i, 0xFFFF), t;
    t = _mm512_permutexvar_ps(p1, v), v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xAAAA, t, v);
    t = _mm512_permutexvar_ps(p2, v), v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xCCCC, t, v);
    t = _mm512_permutexvar_ps(p4, v), v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xF0F0, t, v);
    t = _mm512_permutexvar_ps(p8, v), v = _mm512_mask_sub_ps(_mm512_add_ps(v, t), 0xFF00, t, v);
    _mm512_storeu_ps(out + i, v);
  }
  fwht_across<__m512>(out, k, b, 16, [](const float* p) { return _mm512_loadu_ps(p); },
                      [](float* p, __m512 v) { _mm512_storeu_ps(p, v); },
                      [](__m512 a, __m512 c) { return _mm512_add_ps(a, c); },
                      [](__m512 a, __m512 c) { return _mm512_sub_ps(a, c); });
}

inline void store16(DType dt, void* out, int64_t at, __m512 y) {
  if (dt == DType::BF16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at), conveyor::bf16x16_round(y));
  else
    _mm512_storeu_ps(static_cast<float*>(out) + at, y);
}

// The accumulators are held as GCC's own int32 vector type: as __m512i (a vector of int64) every vpdpbusd result
// is a cast, and GCC 12 then kept all 24 accumulators on the stack (two memory moves per instruction, ~3x slower).
typedef int32_t v16si __attribute__((vector_size(64)));

constexpr int kRows = 6;  // rows per register tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast
constexpr int kCols = 4;  // 16-column blocks per register tile (64 columns)
constexpr int kOffset = 128;

struct Gemm {  // what every tile of one call shares
  const uint8_t* xq;  // [m][kp], xq + 128
  const float* sx;
  const int8_t* w;
  const int32_t* comp;
  const float* sw;
  void* out;
  DType dt;
  int64_t kp, n;
};

// Rows [r0, r0 + R) times column blocks [b0, b0 + NB), the whole K, then the epilogue.
template <int R, int NB>
void tile(const Gemm& g, int64_t r0, int64_t b0) {
  v16si acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = v16si{};
  const int64_t groups = g.kp / 4;
  const int8_t* base = g.w + b0 * groups * 64;
  const uint8_t* x = g.xq + r0 * g.kp;
  for (int64_t q = 0; q < groups; ++q) {
    __m512i b[NB];
    for (int j = 0; j < NB; ++j) {
      const int8_t* p = base + (j * groups + q) * 64;
      // a decode step streams the weights from memory: ask for them 2 KiB (32 groups) ahead of use
      if (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(p + 32 * 64), _MM_HINT_T0);
      b[j] = _mm512_loadu_si512(p);
    }
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * g.kp + q * 4, 4);
      const __m512i a = _mm512_set1_epi32(four);
      for (int j = 0; j < NB; ++j) acc[r][j] = (v16si)_mm512_dpbusd_epi32((__m512i)acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 sxr = _mm512_set1_ps(g.sx[r0 + r]);
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (b0 + j) * 16;
      const __m512i v = _mm512_sub_epi32((__m512i)acc[r][j], _mm512_loadu_si512(g.comp + col));
      const __m512 s = _mm512_mul_ps(sxr, _mm512_loadu_ps(g.sw + col));
      store16(g.dt, g.out, (r0 + r) * g.n + col, _mm512_mul_ps(_mm512_cvtepi32_ps(v), s));
    }
  }
}

template <int R>
void tile_r(const Gemm& g, int64_t r0, int64_t b0, int nb) {
  switch (nb) {
    case 1: return tile<R, 1>(g, r0, b0);
    case 2: return tile<R, 2>(g, r0, b0);
    case 3: return tile<R, 3>(g, r0, b0);
    default: return tile<R, 4>(g, r0, b0);
  }
}

void run_tile(const Gemm& g, int rows, int64_t r0, int64_t b0, int nb) {
  switch (rows) {
    case 1: return tile_r<1>(g, r0, b0, nb);
    case 2: return tile_r<2>(g, r0, b0, nb);
    case 3: return tile_r<3>(g, r0, b0, nb);
    case 4: return tile_r<4>(g, r0, b0, nb);
    case 5: return tile_r<5>(g, r0, b0, nb);
    default: return tile_r<6>(g, r0, b0, nb);
  }
}

#else
// ------------------------------------------------------------------------------------------------------- AVX2

inline __m256 load8(DType dt, const void* x, int64_t i) {
  if (dt == DType::BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(x) + i);
}

inline float load1(DType dt, const void* x, int64_t i) {
  if (dt == DType::BF16) return bits_to_float(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
  return static_cast<const float*>(x)[i];
}

// The same contract as the VNNI build's quantize_row (signed bytes here, offset 0, for vpsignb).
float quantize_row(DType dt, const void* x, int64_t k, int64_t kp, uint8_t* out, int offset) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 mx = _mm256_setzero_ps();
  int bad = 0;
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 a = _mm256_and_ps(load8(dt, x, i), abs_mask);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
    mx = _mm256_max_ps(mx, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; i < k; ++i) {
    const float a = std::fabs(load1(dt, x, i));
    bad |= !(a < std::numeric_limits<float>::infinity());
    amax = std::max(amax, a);
  }
  if (bad) {
    std::memset(out, offset, static_cast<size_t>(kp));
    return std::numeric_limits<float>::quiet_NaN();
  }
  amax = std::max(amax, kMinAbsMax);
  const float inv_s = 127.0f / amax;
  const __m256 inv = _mm256_set1_ps(inv_s);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), off = _mm256_set1_epi32(offset);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(dt, x, i), inv));  // ties to even, as torch.round
    q = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, lo), hi), off);
    // 8 int32 -> 8 bytes: packs work per 128-bit lane, so gather the low bytes by a permutation first
    const __m256i w16 = _mm256_packs_epi32(q, q);          // lane0: q0..q3 q0..q3, lane1: q4..q7 q4..q7
    const __m256i b8 = _mm256_packs_epi16(w16, w16);        // lane0: q0..q3 x4, lane1: q4..q7 x4
    const __m256i both = _mm256_permutevar8x32_epi32(b8, order);  // dword 0: q0..q3, dword 1: q4..q7
    const int64_t two = _mm_cvtsi128_si64(_mm256_castsi256_si128(both));
    std::memcpy(out + i, &two, 8);
  }
  for (; i < k; ++i) {
    const float v = std::nearbyint(load1(dt, x, i) * inv_s);
    out[i] = static_cast<uint8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, v))) + offset);
  }
  std::memset(out + k, offset, static_cast<size_t>(kp - k));
  return amax / 127.0f;
}

// The VNNI build's fwht on 8-lane vectors (b a power of two >= 16, k % b == 0): the same pairs, the same operations.
void fwht(DType dt, const void* x, int64_t k, int64_t b, float* out) {
  for (int64_t i = 0; i < k; i += 8) {  // stages 1, 2, 4 inside each vector: lanes with bit h set take t - v
    __m256 v = load8(dt, x, i), t;
    t = _mm256_permute_ps(v, 0xB1), v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xAA);
    t = _mm256_permute_ps(v, 0x4E), v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xCC);
    t = _mm256_permute2f128_ps(v, v, 0x01), v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xF0);
    _mm256_storeu_ps(out + i, v);
  }
  fwht_across<__m256>(out, k, b, 8, [](const float* p) { return _mm256_loadu_ps(p); },
                      [](float* p, __m256 v) { _mm256_storeu_ps(p, v); },
                      [](__m256 a, __m256 c) { return _mm256_add_ps(a, c); },
                      [](__m256 a, __m256 c) { return _mm256_sub_ps(a, c); });
}

// 8 fp32 -> 8 bf16 as torch rounds them (round to nearest even; NaN -> 0x7FC0).
inline __m128i to_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline void store8(DType dt, void* out, int64_t at, __m256 y) {
  if (dt == DType::BF16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + at), to_bf16_8(y));
  else
    _mm256_storeu_ps(static_cast<float*>(out) + at, y);
}

typedef int32_t v8si __attribute__((vector_size(32)));

constexpr int kRows = 4;  // rows per register tile: 4 x 2 accumulators (one 16-column block) + 2 weights + temps
constexpr int kCols = 1;
constexpr int kOffset = 0;

struct Gemm {
  const uint8_t* xq;  // [m][kp], signed bytes
  const float* sx;
  const int8_t* w;
  const int32_t* comp;  // unused here (no offset)
  const float* sw;
  void* out;
  DType dt;
  int64_t kp, n;
};

template <int R>
void tile(const Gemm& g, int64_t r0, int64_t b0) {
  v8si acc[R][2];  // GCC's int32 vector type, not __m256i: see the VNNI path's note
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v8si{};
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = g.kp / 4;
  const int8_t* base = g.w + b0 * groups * 64;
  const uint8_t* x = g.xq + r0 * g.kp;
  for (int64_t q = 0; q < groups; ++q) {
    const int8_t* p = base + q * 64;
    if (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(p + 32 * 64), _MM_HINT_T0);
    const __m256i b0v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b1v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    const __m256i m0 = _mm256_abs_epi8(b0v), m1 = _mm256_abs_epi8(b1v);  // |q| <= 127, once for all R rows
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * g.kp + q * 4, 4);
      const __m256i a = _mm256_set1_epi32(four);
      acc[r][0] += (v8si)_mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(a, b0v)), ones);
      acc[r][1] += (v8si)_mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(a, b1v)), ones);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 sxr = _mm256_set1_ps(g.sx[r0 + r]);
    for (int h = 0; h < 2; ++h) {
      const int64_t col = b0 * 16 + h * 8;
      const __m256 s = _mm256_mul_ps(sxr, _mm256_loadu_ps(g.sw + col));
      store8(g.dt, g.out, (r0 + r) * g.n + col, _mm256_mul_ps(_mm256_cvtepi32_ps((__m256i)acc[r][h]), s));
    }
  }
}

void run_tile(const Gemm& g, int rows, int64_t r0, int64_t b0, int nb) {
  for (int j = 0; j < nb; ++j) switch (rows) {
      case 1: tile<1>(g, r0, b0 + j); break;
      case 2: tile<2>(g, r0, b0 + j); break;
      case 3: tile<3>(g, r0, b0 + j); break;
      default: tile<4>(g, r0, b0 + j); break;
    }
}
#endif

constexpr int64_t kGroupBlocks = 4;  // 16-column blocks per work item (their weights stay in L2 across its rows)

// Rows [r0, r1) of x quantized into out (row stride kp), scales into scale: with `had` > 0, each row's blocks of
// `had` values Walsh-Hadamard transformed first (in fp32, in a buffer of this call's own).
void quantize_rows(DType dt, const void* x, int64_t k, int64_t kp, int64_t had, int64_t r0, int64_t r1, uint8_t* out,
                   float* scale, int offset) {
  const size_t es = dt == DType::BF16 ? 2 : 4;
  std::unique_ptr<float[]> buf(had > 0 ? new float[k] : nullptr);
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = static_cast<const char*>(x) + r * k * es;
    if (had > 0) {
      fwht(dt, row, k, had, buf.get());
      scale[r] = quantize_row(DType::F32, buf.get(), k, kp, out + r * kp, offset);
    } else {
      scale[r] = quantize_row(dt, row, k, kp, out + r * kp, offset);
    }
  }
}

}  // namespace

// x [m, k] (fp32 or bf16, dt) -> q int8 [m, k] and scale fp32 [m], as linear_w8a8 quantizes its input (tests
// compare it with the torch reference; the kernel keeps its own, possibly offset, copy).
void w8a8_quantize(DType dt, const void* x, int64_t m, int64_t k, int64_t had, int8_t* q, float* scale) {
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(dt, x, k, k, had, r0, r1, reinterpret_cast<uint8_t*>(q), scale, 0);
  });
}

// out [m, n] = the W8A8 product of x [m, k] (fp32 or bf16, dt) and the packed weight (w [n/16][kp/4][16][4],
// comp [n], sw [n]), in dt; n % 16 == 0 (the bindings check). had > 0: x's rows are Walsh-Hadamard transformed in
// blocks of `had` before they are quantized (the weight was transformed alike at load: w8a8.py says why).
//
// Work items are (rows of one chunk, 64 columns), chunk-major, handed out by parallel_items (kernel_api.h): a
// chunk's quantized activations (~256 KiB) stay in L2 while its columns pass, and an item's weights (64 x kp
// bytes) stay in L2 while its rows pass in register tiles. Which thread runs an item never changes a bit.
void linear_w8a8(DType dt, const void* x, const int8_t* w, const int32_t* comp, const float* sw, void* out, int64_t m,
                 int64_t k, int64_t n, int64_t had) {
  const int64_t kp = padded_k(k), nblk = n / 16;
  Scratch xq(static_cast<size_t>(m * kp)), sx(static_cast<size_t>(m) * sizeof(float));
  float* sxp = reinterpret_cast<float*>(sx.p);
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) { quantize_rows(dt, x, k, kp, had, r0, r1, xq.p, sxp, kOffset); });
  const Gemm g{xq.p, sxp, w, comp, sw, out, dt, kp, n};
  const int64_t chunk = std::max<int64_t>(4 * kRows, (int64_t(256) << 10) / kp / kRows * kRows);
  const int64_t groups = (nblk + kGroupBlocks - 1) / kGroupBlocks, chunks = (m + chunk - 1) / chunk;
  parallel_items(groups * chunks, [&](int64_t i) {
    const int64_t m0 = (i / groups) * chunk, m1 = std::min(m, m0 + chunk);
    const int64_t b = (i % groups) * kGroupBlocks, bend = std::min(nblk, b + kGroupBlocks);
    for (int64_t j = b; j < bend; j += kCols) {
      const int nb = static_cast<int>(std::min<int64_t>(kCols, bend - j));
      for (int64_t r = m0; r < m1; r += kRows) run_tile(g, static_cast<int>(std::min<int64_t>(kRows, m1 - r)), r, j, nb);
    }
  });
}

#if CONVEYOR_W8A8_AMX
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kAmxRowChunk = 256;  // rows per pass over a thread's weights (their activations stay in L2)
constexpr int kAmxPrefetch = 4;  // B tiles asked for this many 64-wide K steps ahead (a decode step streams them)

inline void prefetch_b(const int8_t* p) {
  for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + l * 64), _MM_HINT_T0);
}

// The epilogue of rows [r, r + rows) of the C tile in cbuf (16 x 16 int32) at column block blk: as tile()'s.
inline void amx_epilogue(const Gemm& g, const int32_t* cbuf, int64_t r, int64_t rows, int64_t blk) {
  const int64_t col = blk * 16;
  const __m512i comp = _mm512_loadu_si512(g.comp + col);
  const __m512 sw = _mm512_loadu_ps(g.sw + col);
  for (int64_t i = 0; i < rows; ++i) {
    const __m512i v = _mm512_sub_epi32(_mm512_load_si512(cbuf + i * 16), comp);
    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(g.sx[r + i]), sw);
    store16(g.dt, g.out, (r + i) * g.n + col, _mm512_mul_ps(_mm512_cvtepi32_ps(v), s));
  }
}

// Two 16-row groups (A in tiles 4, 5) times NB (1 or 2) column blocks from b0 (B in 6, 7), the whole K: C tiles
// 0, 1 (first group) and 2, 3 (second), stored to cbuf at 0, 256, 512, 768.
template <int NB>
inline void amx_2x2(const Gemm& g, const uint8_t* a0, const uint8_t* a1, int64_t b0, int32_t* cbuf) {
  _tile_zero(0);
  _tile_zero(2);
  if (NB > 1) { _tile_zero(1); _tile_zero(3); }
  const int64_t groups = g.kp / 4, step = groups * 64;  // bytes from one column block to the next
  const int8_t* wb0 = g.w + b0 * step;
  for (int64_t k0 = 0; k0 < g.kp; k0 += 64) {
    const int8_t* wb = wb0 + k0 * 16;  // 16 groups of 4 k (64 bytes each) per 64 k
    if (k0 + 64 * kAmxPrefetch < g.kp)
      for (int j = 0; j < NB; ++j) prefetch_b(wb + j * step + kAmxPrefetch * 1024);
    _tile_loadd(4, a0 + k0, g.kp);
    _tile_loadd(5, a1 + k0, g.kp);
    _tile_loadd(6, wb, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(2, 5, 6);
    if (NB > 1) {
      _tile_loadd(7, wb + step, 64);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 64);
  _tile_stored(2, cbuf + 512, 64);
  if (NB > 1) { _tile_stored(1, cbuf + 256, 64); _tile_stored(3, cbuf + 768, 64); }
}

// One 16-row group (A in tile 4) times NB (1-4) column blocks from b0: C tiles 0-3, B in 5-7 (the fourth block's
// B goes to tile 5 again). A decode step of up to 16 rows: each A load serves four blocks.
template <int NB>
inline void amx_1xn(const Gemm& g, const uint8_t* a, int64_t b0, int32_t* cbuf) {
  if (NB > 0) _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const int64_t groups = g.kp / 4, step = groups * 64;
  const int8_t* wb0 = g.w + b0 * step;
  for (int64_t k0 = 0; k0 < g.kp; k0 += 64) {
    const int8_t* wb = wb0 + k0 * 16;
    if (k0 + 64 * kAmxPrefetch < g.kp)
      for (int j = 0; j < NB; ++j) prefetch_b(wb + j * step + kAmxPrefetch * 1024);
    _tile_loadd(4, a + k0, g.kp);
    if (NB > 0) { _tile_loadd(5, wb, 64); _tile_dpbusd(0, 4, 5); }
    if (NB > 1) { _tile_loadd(6, wb + step, 64); _tile_dpbusd(1, 4, 6); }
    if (NB > 2) { _tile_loadd(7, wb + 2 * step, 64); _tile_dpbusd(2, 4, 7); }
    if (NB > 3) { _tile_loadd(5, wb + 3 * step, 64); _tile_dpbusd(3, 4, 5); }
  }
  if (NB > 0) _tile_stored(0, cbuf, 64);
  if (NB > 1) _tile_stored(1, cbuf + 256, 64);
  if (NB > 2) _tile_stored(2, cbuf + 512, 64);
  if (NB > 3) _tile_stored(3, cbuf + 768, 64);
}

}  // namespace

// linear_w8a8 on AMX tiles where K (padded to 4) is a multiple of 64, the A tile's width; other shapes take the
// VNNI path (the same bits). Each thread of torch's pool owns an equal share of the 16-column blocks and passes
// over them once per chunk of rows. The quantized activations are kept with their rows padded to a whole tile.
void linear_w8a8_amx(DType dt, const void* x, const int8_t* w, const int32_t* comp, const float* sw, void* out,
                     int64_t m, int64_t k, int64_t n, int64_t had) {
  const int64_t kp = padded_k(k), nblk = n / 16;
  if (kp % 64 != 0 || m == 0) return linear_w8a8(dt, x, w, comp, sw, out, m, k, n, had);
  const int64_t mp = (m + kTileRows - 1) / kTileRows * kTileRows;
  Scratch xq(static_cast<size_t>(mp * kp)), sx(static_cast<size_t>(m) * sizeof(float));
  float* sxp = reinterpret_cast<float*>(sx.p);
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) { quantize_rows(dt, x, k, kp, had, r0, r1, xq.p, sxp, kOffset); });
  std::memset(xq.p + m * kp, 0, static_cast<size_t>((mp - m) * kp));  // the padding rows: read, never stored
  const Gemm g{xq.p, sxp, w, comp, sw, out, dt, kp, n};
  const int64_t nt = get_num_threads();
  parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    amx::configure();
    alignas(64) int32_t cbuf[4 * 256];
    for (int64_t th = t0; th < t1; ++th) {
      const int64_t lo = nblk * th / nt, hi = nblk * (th + 1) / nt;
      for (int64_t m0 = 0; m0 < m; m0 += kAmxRowChunk) {
        const int64_t m1 = std::min(m, m0 + kAmxRowChunk);
        for (int64_t b = lo; b < hi; b += 4) {
          const int nb = static_cast<int>(std::min<int64_t>(4, hi - b));
          int64_t r = m0;
          for (; r + kTileRows < m1; r += 2 * kTileRows) {  // two row groups at a time (prefill, large batches)
            const int64_t rows1 = std::min<int64_t>(kTileRows, m1 - r - kTileRows);
            for (int j = 0; j < nb; j += 2) {
              const uint8_t* a0 = xq.p + r * kp;
              if (nb - j >= 2) amx_2x2<2>(g, a0, a0 + kTileRows * kp, b + j, cbuf);
              else amx_2x2<1>(g, a0, a0 + kTileRows * kp, b + j, cbuf);
              for (int c = 0; c < std::min(2, nb - j); ++c) {
                amx_epilogue(g, cbuf + c * 256, r, kTileRows, b + j + c);
                amx_epilogue(g, cbuf + (c + 2) * 256, r + kTileRows, rows1, b + j + c);
              }
            }
          }
          if (r < m1) {  // one row group left (a decode step of up to 16 rows)
            const uint8_t* a = xq.p + r * kp;
            switch (nb) {
              case 1: amx_1xn<1>(g, a, b, cbuf); break;
              case 2: amx_1xn<2>(g, a, b, cbuf); break;
              case 3: amx_1xn<3>(g, a, b, cbuf); break;
              default: amx_1xn<4>(g, a, b, cbuf); break;
            }
            for (int j = 0; j < nb; ++j) amx_epilogue(g, cbuf + j * 256, r, std::min<int64_t>(kTileRows, m1 - r), b + j);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif
#endif

void register_linear_w8a8(Table& t) {
#if CONVEYOR_W8A8
  t.linear_w8a8 = &linear_w8a8;
  t.w8a8_quantize = &w8a8_quantize;
  t.w8a8_isa = CONVEYOR_W8A8 == 1 ? "avx512-vnni" : "avx2";
#if CONVEYOR_W8A8_AMX
  if (amx::ready(amx::kInt8)) {
    t.linear_w8a8 = &linear_w8a8_amx;
    t.w8a8_isa = "amx-int8";
  }
#endif
#else
  (void)t;
#endif
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
