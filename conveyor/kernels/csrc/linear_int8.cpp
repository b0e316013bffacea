// int8 weight-only linear for AVX2 + FMA: y [M, N] = x [M, K] @ W^T, W held as int8 with one fp32 scale per
// output channel (w = q * scale), as `--quantization int8` and the LM head under int4 keep them.
//
// Why our own: torch's `_weight_int8pack_mm` took 2.6 ms for SmolLM2's LM head (49,152 x 576) at one row on a
// 2-core Zen 3, a third of an int4 decode step, where streaming its 28 MB takes ~1.3 ms.
//
// Layout (conveyor/model/quantization.py packs it): columns in blocks of 16; per block, K rows of 16 bytes
// (column j's q[k] at byte j of row k): one contiguous stream per block, an 8-byte load widened to 8 lanes.
//
// Numerics, the same for every output whatever the rows beside it (batch-invariant by construction): two
// FMA chains (even k, odd k) of q * x in k order, added, times the scale; one rounding to the output dtype.
#include <algorithm>
#include <cstdint>
#include <memory>

#include "kernel_api.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_HAS_INT8_LINEAR 1
#else
#define CONVEYOR_HAS_INT8_LINEAR 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

#if CONVEYOR_HAS_INT8_LINEAR
#include "linear_common.h"

namespace {

constexpr int kRows = 3;  // rows per pass over the weights (2 x 3 x 2 accumulators)
constexpr int64_t kColBlocks = 4;  // 16-column blocks whose weights stay in L2 across the row passes

// R rows (x: fp32 [R][K]) times one 16-column block b (two 8-lane halves); results to out rows.
template <int R>
inline void tile(const float* x, int64_t k, const int8_t* q, const float* scale, int64_t b, DType dt, void* out,
                 int64_t n) {
  __m256 even[R][2], odd[R][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) even[r][c] = odd[r][c] = _mm256_setzero_ps();
  const int8_t* qb = q + b * k * 16;
  for (int64_t kk = 0; kk < k; kk += 2) {
    for (int c = 0; c < 2; ++c) {
      const __m256 we = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + kk * 16 + c * 8))));
      const __m256 wo = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + (kk + 1) * 16 + c * 8))));
      for (int r = 0; r < R; ++r) {
        even[r][c] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(x + r * k + kk), even[r][c]);
        odd[r][c] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(x + r * k + kk + 1), odd[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(scale + b * 16 + c * 8), _mm256_add_ps(even[r][c], odd[r][c]));
      const int64_t at = r * n + b * 16 + c * 8;
      store8(dt, out, at, v);
    }
}

}  // namespace

// x [M, K] (fp32 or bf16, `dt`), q [N/16, K, 16] and scale [N] as packed above, out [M, N] in `dt`; N % 16 == 0,
// K even (the bindings check; an odd K's tail after the loop made GCC keep every accumulator on the stack).
void linear_int8(DType dt, const void* xv, const int8_t* q, const float* scale, void* out, int64_t m, int64_t k,
                 int64_t n) {
  const int64_t nblk = n / 16;
  float* const xf = scratch_floats(0, static_cast<size_t>(m * k));  // the activations in fp32 once
  rows_to_fp32(dt, xv, m, k, xf);
  const size_t esize = dt == DType::BF16 ? 2 : 4;
  over_blocks_and_rows(nblk, m, kColBlocks, kRows, [&](int64_t b, int64_t e, int64_t r, int rr) {
    const float* x = xf + r * k;
    void* o = static_cast<char*>(out) + static_cast<size_t>(r * n) * esize;
    for (int64_t j = b; j < e; ++j) {
      switch (rr) {
        case 1: tile<1>(x, k, q, scale, j, dt, o, n); break;
        case 2: tile<2>(x, k, q, scale, j, dt, o, n); break;
        default: tile<3>(x, k, q, scale, j, dt, o, n); break;
      }
    }
  });
}
#endif

void register_linear_int8(Table& t) {
#if CONVEYOR_HAS_INT8_LINEAR
  t.linear_int8 = &linear_int8;
#else
  (void)t;
#endif
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
