// bf16 linear layers on AMX tiles (TDPBF16PS), for any number of rows, on linear_bf16_pack's weights.
//
// Why: on an Intel Xeon with AMX, oneDNN's prepacked matmul runs a decode step's 64 rows fast (AMX) but
// one row ~2.5x slower than our vdpbf16ps kernel, which in turn is ~10x slower than AMX at 64 rows; one
// kernel must serve every row count (batch invariance), so neither was right for both. Tiles do both: a
// tile op multiplies 16 rows by 32 K by 16 columns, and at one row it still reads each weight once.
//
// Batch invariance by construction: each output element accumulates in one fp32 tile element, over K in
// 32-wide steps from k = 0, in order; a row's chain never depends on the other rows of its tile (rows
// beyond M are zeros from a padded copy), so a row's result is the same bits whatever the number of rows.
// Rounded to bf16 once at the end (round to nearest even, as linear_bf16).
//
// Weight layout: linear_bf16_pack's [N/16][K/2][16][2], which is exactly a stack of AMX B tiles: for a
// block of 16 columns, 16 consecutive K pairs are 16 rows of 64 bytes. K must be a multiple of 32.

#include "kernel_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include "amx_tiles.h"
#define CONVEYOR_HAS_AMX 1
#else
#define CONVEYOR_HAS_AMX 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

#if CONVEYOR_HAS_AMX
namespace {

constexpr int kTileRows = 16;
constexpr int kColBlocks = 4;  // C tiles 0-3: 4 blocks of 16 columns; tile 4: A; tiles 5-7: B
constexpr int64_t kRowChunk = 256;  // rows per pass over the weights (a multiple of 2 x kTileRows)

constexpr int kPrefetchSteps = 4;  // B tiles fetched this many 32-wide K steps ahead (1 KiB each)

inline void prefetch_tile(const uint16_t* p) {
  for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + l * 32), _MM_HINT_T0);
}

// C tiles of one 16-row group (tile 4 holds its A) times column blocks [b0, b0 + NB), over the whole K.
// A decode step streams the weights from memory: tile loads are not prefetched by the hardware, so the
// B tiles kPrefetchSteps ahead are asked for explicitly (one stream of SmolLM2's LM head: 13 -> ~1 ms).
template <int NB>
inline void tile_block(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t kp, int64_t b0, int64_t k,
                       float* cbuf) {
  if (NB > 0) _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const int64_t step = kp * 32;  // one column block further
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    _tile_loadd(4, a + k0, lda * 2);
    const uint16_t* wb = w + (b0 * kp + k0 / 2) * 32;
    if (k0 + 32 * kPrefetchSteps < k)
      for (int j = 0; j < NB; ++j) prefetch_tile(wb + j * step + kPrefetchSteps * 512);
    if (NB > 0) { _tile_loadd(5, wb, 64); _tile_dpbf16ps(0, 4, 5); }
    if (NB > 1) { _tile_loadd(6, wb + step, 64); _tile_dpbf16ps(1, 4, 6); }
    if (NB > 2) { _tile_loadd(7, wb + 2 * step, 64); _tile_dpbf16ps(2, 4, 7); }
    if (NB > 3) { _tile_loadd(5, wb + 3 * step, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  if (NB > 0) _tile_stored(0, cbuf, 64);
  if (NB > 1) _tile_stored(1, cbuf + 256, 64);
  if (NB > 2) _tile_stored(2, cbuf + 512, 64);
  if (NB > 3) _tile_stored(3, cbuf + 768, 64);
}

// Two 16-row groups (A in tiles 4 and 5) times two column blocks [b0, b0 + NB): C tiles 0, 1 (first group)
// and 2, 3 (second), two tile loads per two tile ops instead of five per four. The same chains as
// tile_block's, so a row's bits do not depend on which of the two ran it.
template <int NB>
inline void tile_block_2x2(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* w, int64_t kp,
                           int64_t b0, int64_t k, float* cbuf) {
  _tile_zero(0);
  _tile_zero(2);
  if (NB > 1) { _tile_zero(1); _tile_zero(3); }
  const int64_t step = kp * 32;
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    _tile_loadd(4, a0 + k0, lda * 2);
    _tile_loadd(5, a1 + k0, lda * 2);
    const uint16_t* wb = w + (b0 * kp + k0 / 2) * 32;
    _tile_loadd(6, wb, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (NB > 1) {
      _tile_loadd(7, wb + step, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 64);
  _tile_stored(2, cbuf + 512, 64);
  if (NB > 1) { _tile_stored(1, cbuf + 256, 64); _tile_stored(3, cbuf + 768, 64); }
}

// Rows [r, r + rows) of C tile `c` (in cbuf) to out, at column block `blk`.
inline void store_rows(const float* cbuf, int c, uint16_t* out, int64_t r, int64_t rows, int64_t n, int64_t blk) {
  for (int64_t i = 0; i < rows; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r + i) * n + blk * 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(cbuf + c * 256 + i * 16)));
}

}  // namespace

// out [M, N] = x [M, K] @ W^T on AMX tiles, x and W in bf16 (W packed by linear_bf16_pack), fp32 accumulation;
// the caller checks the shapes (K % 32 == 0). packed: [N/16][K/2][16][2]; out: [M, N].
void linear_amx(const uint16_t* xd, const uint16_t* wd, uint16_t* od, int64_t m, int64_t k, int64_t nblk) {
  const int64_t n = nblk * 16, kp = k / 2;
  const int64_t full = m / kTileRows * kTileRows;
  std::vector<uint16_t> tail;  // the last rows, zero-padded to a whole tile (read by every thread)
  if (full < m) {
    tail.assign(kTileRows * k, 0);
    std::memcpy(tail.data(), xd + full * k, (m - full) * k * sizeof(uint16_t));
  }
  auto rows_at = [&](int64_t r) -> const uint16_t* { return r < full ? xd + r * k : tail.data(); };
  // one chunk per thread of torch's pool (`--threads`): each owns an equal share of the 16-column blocks
  const int64_t nt = get_num_threads();
  parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    amx::configure();
    alignas(64) float cbuf[kColBlocks * 256];
    for (int64_t th = t0; th < t1; ++th) {
      const int64_t lo = nblk * th / nt, hi = nblk * (th + 1) / nt;
      // rows in chunks whose activations stay in L2 while every column block of this thread passes over them
      for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
        const int64_t m1 = std::min(m, m0 + kRowChunk);
        for (int64_t b = lo; b < hi; b += kColBlocks) {
          const int nb = static_cast<int>(std::min<int64_t>(kColBlocks, hi - b));
          int64_t r = m0;
          for (; r + kTileRows < m1; r += 2 * kTileRows) {  // two row groups at a time (prefill, large batches)
            const int64_t rows1 = std::min<int64_t>(kTileRows, m1 - r - kTileRows);
            for (int j = 0; j < nb; j += 2) {
              if (nb - j >= 2) tile_block_2x2<2>(rows_at(r), rows_at(r + kTileRows), k, wd, kp, b + j, k, cbuf);
              else tile_block_2x2<1>(rows_at(r), rows_at(r + kTileRows), k, wd, kp, b + j, k, cbuf);
              for (int c = 0; c < std::min(2, nb - j); ++c) {
                store_rows(cbuf, c, od, r, kTileRows, n, b + j + c);
                store_rows(cbuf, c + 2, od, r + kTileRows, rows1, n, b + j + c);
              }
            }
          }
          if (r < m1) {  // one row group left (a decode step of up to 16 rows: four column blocks per A load)
            switch (nb) {
              case 1: tile_block<1>(rows_at(r), k, wd, kp, b, k, cbuf); break;
              case 2: tile_block<2>(rows_at(r), k, wd, kp, b, k, cbuf); break;
              case 3: tile_block<3>(rows_at(r), k, wd, kp, b, k, cbuf); break;
              default: tile_block<4>(rows_at(r), k, wd, kp, b, k, cbuf); break;
            }
            for (int j = 0; j < nb; ++j) store_rows(cbuf, j, od, r, std::min<int64_t>(kTileRows, m1 - r), n, b + j);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

void register_linear_amx(Table& t) {
#if CONVEYOR_HAS_AMX
  if (amx::ready(amx::kBf16)) t.linear_amx = &linear_amx;
#else
  (void)t;
#endif
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
