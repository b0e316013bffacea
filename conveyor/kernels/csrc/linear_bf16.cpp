// bf16 linear layers with the AVX-512 BF16 dot-product instruction (vdpbf16ps), for any number of rows.
//
// Why our own: on the AMD EPYC (Zen 4) we measured, oneDNN's prepacked bf16 matmul reads a decode step's
// weights at ~11-13 GB/s for one or two rows, well under the machine's streaming rate, while this kernel
// reads them at ~27 GB/s (SmolLM2's 30 layers at one row: 16-19 ms -> 8 ms) and matches or beats
// oneDNN at 64 and 512 rows. Which one runs is chosen at startup by measurement (packed_linear.py).
//
// Batch invariance by construction: every output element is one chain of vdpbf16ps over K, pair after
// pair from k = 0, in one fp32 accumulator, rounded to bf16 once at the end. Row blocking, column
// blocking and the thread split only decide *which* chains run together, never the order inside one,
// so a row's result is the same bits whatever the number of rows beside it.
//
// Weight layout ("packed"): [N/16][K/2][16][2] bf16: for each block of 16 output columns, the K pairs in
// order, each pair of the 16 columns as one 64-byte vector (the operand vdpbf16ps takes).

// Compiled into the variants whose -march has AVX-512 BF16 only; elsewhere the Table's entry stays null and
// linear_bf16_available() says false. The packing (a view + permute) is torch code, in bindings.cpp.

#include "kernel_api.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define CONVEYOR_HAS_DPBF16 1
#else
#define CONVEYOR_HAS_DPBF16 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

#if CONVEYOR_HAS_DPBF16
namespace {

constexpr int kRowsMax = 6;   // rows per register block: 6 x 4 accumulators + 4 weight vectors
constexpr int kColBlocks = 4;  // 16-column blocks per register block (64 columns)
constexpr int64_t kRowChunk = 128;  // rows per pass over the weights (their activations stay in L2)

// rows [0, R) of x (as K/2 pairs) times column blocks [b0, b0 + nb) of the packed weight, the whole K.
template <int R>
inline void block(const uint32_t* x, int64_t kp, const uint16_t* w, int64_t b0, int nb, uint16_t* out, int64_t n) {
  __m512 acc[R][kColBlocks];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kColBlocks; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* base = w + b0 * kp * 32;
  if (nb == kColBlocks) {
    for (int64_t k = 0; k < kp; ++k) {
      __m512bh b[kColBlocks];
      for (int j = 0; j < kColBlocks; ++j) {
        // a decode step streams the weights from memory: ask for them 2 KiB (32 pairs) ahead of use
        if (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(base + (j * kp + k + 32) * 32), _MM_HINT_T0);
        b[j] = (__m512bh)_mm512_loadu_si512(base + (j * kp + k) * 32);
      }
      for (int r = 0; r < R; ++r) {
        __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + k]));
        for (int j = 0; j < kColBlocks; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
      }
    }
  } else {  // the last, narrower column block: the same chains, fewer of them
    for (int64_t k = 0; k < kp; ++k)
      for (int j = 0; j < nb; ++j) {
        __m512bh b = (__m512bh)_mm512_loadu_si512(base + (j * kp + k) * 32);
        for (int r = 0; r < R; ++r)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + k])), b);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nb; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n + (b0 + j) * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

void rows(int r, const uint32_t* x, int64_t kp, const uint16_t* w, int64_t b0, int nb, uint16_t* out, int64_t n) {
  switch (r) {
    case 1: return block<1>(x, kp, w, b0, nb, out, n);
    case 2: return block<2>(x, kp, w, b0, nb, out, n);
    case 3: return block<3>(x, kp, w, b0, nb, out, n);
    case 4: return block<4>(x, kp, w, b0, nb, out, n);
    case 5: return block<5>(x, kp, w, b0, nb, out, n);
    default: return block<6>(x, kp, w, b0, nb, out, n);
  }
}

}  // namespace

// out [M, N] = x [M, K] @ W^T, x and W in bf16 (W packed by linear_bf16_pack), fp32 accumulation; the
// caller checks the shapes. x: [M, K/2] bf16 pairs; packed: [N/16][K/2][16][2]; out: [M, N].
//
// Work items are (row chunk, 64-column group), in row chunk order (a chunk's activations stay in L2 while its
// columns pass), handed to the threads of torch's pool by parallel_items (kernel_api.h says why not equal
// static shares). Which thread computes an output never changes its bits: the chain over K is the same.
void linear_bf16(const uint32_t* xd, const uint16_t* wd, uint16_t* od, int64_t m, int64_t k, int64_t nblk) {
  const int64_t n = nblk * 16, kp = k / 2;
  const int64_t groups = (nblk + kColBlocks - 1) / kColBlocks, chunks = (m + kRowChunk - 1) / kRowChunk;
  parallel_items(groups * chunks, [&](int64_t i) {
    const int64_t m0 = (i / groups) * kRowChunk, m1 = std::min(m, m0 + kRowChunk), b = (i % groups) * kColBlocks;
    const int nb = static_cast<int>(std::min<int64_t>(kColBlocks, nblk - b));
    for (int64_t r = m0; r < m1; r += kRowsMax) {
      const int rr = static_cast<int>(std::min<int64_t>(kRowsMax, m1 - r));
      rows(rr, xd + r * kp, kp, wd, b, nb, od + r * n, n);
    }
  });
}
#endif

void register_linear_bf16(Table& t) {
#if CONVEYOR_HAS_DPBF16
  t.linear_bf16 = &linear_bf16;
#else
  (void)t;
#endif
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
