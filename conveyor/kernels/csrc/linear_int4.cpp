// int4 weight-only linear for AVX2 + FMA: y [M, N] = x [M, K] @ W^T, W held as 4-bit integers in groups of 32
// inputs with an fp32 scale and zero each (w = (q - 8) * scale + zero, GGUF's Q4_0/Q4_1 blocks).
//
// Why our own: a one-stream decode step streams every weight once, so int4 should be ~4x cheaper than bf16
// in memory traffic. torch's `_weight_int4pack_mm_for_cpu` is not, on an AVX2 CPU: on a 2-core Zen 3 a
// SmolLM2 decode step with it took 17.7 ms against 12.8 ms in bf16, and llama.cpp's Q4_1 9.1 ms.
//
// Layout (conveyor/model/quantization.py packs it): columns in blocks of 16; per block, K/2 rows of 16 bytes,
// byte j of row i holding column j's q[2i] (low nibble) and q[2i + 1] (high nibble): one 8-byte load widened
// to 8 lanes gives two k's of 8 columns after a mask and a shift. Per block and group: 16 scales, then 16
// "zeros" z' = zero - 8 * scale, so that sum_k w x = scale * sum_k q x + z' * sum_k x over the group. A block's
// weights are one contiguous stream, its scales another (with 8-column blocks read two at a time, a decode step
// streamed at 10 GB/s from memory on one Zen 3 core, which reads 17 GB/s).
//
// Numerics, the same for every output whatever the rows beside it (batch-invariant by construction): per
// group, two FMA chains (even k, odd k) of q * x in k order, added; then y = fma(scale, that, y) and
// y = fma(z', group sum of x, y), groups in order; one rounding to the output dtype at the end.
#include <algorithm>
#include <cstdint>
#include <memory>

#include "kernel_api.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_HAS_INT4_LINEAR 1
#else
#define CONVEYOR_HAS_INT4_LINEAR 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

#if CONVEYOR_HAS_INT4_LINEAR
#include "linear_common.h"

namespace {

constexpr int64_t kGroupK = 32;  // inputs per quantization group
constexpr int kRows = 3;         // rows per pass over the weights (2 x 3 x 2 accumulators)
constexpr int64_t kColBlocks = 4;  // 16-column blocks whose weights stay in L2 across the row passes

// R rows (x: fp32 [R][K], xs: [R][groups]) times one 16-column block b (two 8-lane halves); results to out rows.
// The block's weights are one contiguous stream (and its scales another): what the prefetchers follow best.
template <int R>
inline void tile(const float* x, const float* xs, int64_t k, int64_t groups, const uint8_t* q, const float* sz,
                 int64_t b, DType dt, void* out, int64_t n) {
  // the outputs' running sums live in L1, touched once a group: in registers they would crowd the FMA chains
  alignas(32) float y[R][2][8] = {};
  const __m256i low = _mm256_set1_epi32(0xF);
  const uint8_t* qb = q + b * (k / 2) * 16;
  const float* sb = sz + b * groups * 32;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 even[R][2], odd[R][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c) even[r][c] = odd[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kGroupK / 2; ++i) {
      const int64_t kk = g * kGroupK + 2 * i;
      const uint8_t* qp = qb + (kk / 2) * 16;
      // no software prefetch: on these two contiguous streams the hardware's does better (Zen 3, one core, cold:
      // 16.4 G weights/s without, 15.3 with lines asked for 2 KiB ahead)
      for (int c = 0; c < 2; ++c) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qp + c * 8)));
        const __m256 we = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
        const __m256 wo = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        for (int r = 0; r < R; ++r) {
          even[r][c] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(x + r * k + kk), even[r][c]);
          odd[r][c] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(x + r * k + kk + 1), odd[r][c]);
        }
      }
    }
    for (int c = 0; c < 2; ++c) {
      const float* s = sb + g * 32 + c * 8;  // 16 scales, then 16 zeros
      const __m256 sv = _mm256_loadu_ps(s), zv = _mm256_loadu_ps(s + 16);
      for (int r = 0; r < R; ++r) {
        __m256 acc = _mm256_fmadd_ps(sv, _mm256_add_ps(even[r][c], odd[r][c]), _mm256_load_ps(y[r][c]));
        _mm256_store_ps(y[r][c], _mm256_fmadd_ps(zv, _mm256_broadcast_ss(xs + r * groups + g), acc));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) {
      const int64_t at = r * n + b * 16 + c * 8;
      store8(dt, out, at, _mm256_load_ps(y[r][c]));
    }
}

void pass(int rr, const float* x, const float* xs, int64_t k, int64_t groups, const uint8_t* q, const float* sz,
          int64_t b, int64_t e, DType dt, void* out, int64_t n) {
  for (int64_t j = b; j < e; ++j) {
    switch (rr) {
      case 1: tile<1>(x, xs, k, groups, q, sz, j, dt, out, n); break;
      case 2: tile<2>(x, xs, k, groups, q, sz, j, dt, out, n); break;
      default: tile<3>(x, xs, k, groups, q, sz, j, dt, out, n); break;
    }
  }
}

}  // namespace

// x [M, K] (fp32 or bf16, `dt`), q and sz as packed above, out [M, N] in `dt`; K % 32 == 0, N % 16 == 0 (the
// bindings check).
void linear_int4(DType dt, const void* xv, const uint8_t* q, const float* sz, void* out, int64_t m, int64_t k,
                 int64_t n) {
  const int64_t groups = k / kGroupK, nblk = n / 16;
  // the activations in fp32 once, and each group's sum (for the zeros), summed in k order
  float* const xf = scratch_floats(0, static_cast<size_t>(m * k));
  float* const xs = scratch_floats(1, static_cast<size_t>(m * groups));
  rows_to_fp32(dt, xv, m, k, xf);
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* dst = xf + r * k;
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int64_t i = 0; i < kGroupK; ++i) s += dst[g * kGroupK + i];
        xs[r * groups + g] = s;
      }
    }
  });
  const size_t esize = dt == DType::BF16 ? 2 : 4;
  over_blocks_and_rows(nblk, m, kColBlocks, kRows, [&](int64_t b, int64_t e, int64_t r, int rr) {
    pass(rr, xf + r * k, xs + r * groups, k, groups, q, sz, b, e, dt,
         static_cast<char*>(out) + static_cast<size_t>(r * n) * esize, n);
  });
}
#endif

void register_linear_int4(Table& t) {
#if CONVEYOR_HAS_INT4_LINEAR
  t.linear_int4 = &linear_int4;
#else
  (void)t;
#endif
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
