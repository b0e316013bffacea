// What the AVX2 linear kernels (linear_avx2.cpp, linear_int4.cpp, linear_int8.cpp) share: fp32 lanes rounded to
// bf16 as torch rounds them, and activations widened to fp32 once per call. Included inside a kernel file's
// variant namespace (it uses that variant's parallel_for), after <immintrin.h>, <algorithm> and <memory>.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
// 8 fp32 -> 8 bf16 (round to nearest even; NaN stays a quiet NaN), as torch's c10::BFloat16 rounds.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: 4 words, 4 words (again)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // lanes' first halves, in order
}

// `rows` rows of 16 fp32 (`c`, row-major, 32-byte aligned) -> bf16 at out + r * n, as to_bf16 rounds. Kept out of
// line on purpose: inlined into a register-blocked loop, the compiler hoists to_bf16's three constants out of the
// loop into registers, and a 6 x 16 block (12 accumulators, 2 weight vectors, 1 broadcast: 15 of the 16 ymm
// registers) then spills two accumulators through the stack on every k (a store-to-load chain each iteration):
// 85 GFLOP/s where the same FMAs unspilled run 166-192 on a Zen 3 (`linear_avx2`, 256 rows; see block6_f32).
__attribute__((noinline)) inline void store_rows_bf16(const float* c, int rows, uint16_t* out, int64_t n) {
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * n + h * 8), to_bf16(_mm256_load_ps(c + r * 16 + h * 8)));
}

// A buffer of at least n floats, uninitialised: the calling thread's `slot` (0 or 1), kept between calls and only
// ever grown. Why not a std::vector per call: a 2,048-token step's down_proj widens 2,048 x 8,192 activations (64
// MiB, above glibc's mmap threshold), so each call got a fresh mapping whose every page faulted in again and was
// zeroed, every layer: down_proj ran at 133-162 GFLOP/s against 169-183 with this buffer on a Zen 3 (two threads,
// two alternating rounds; docs/performance.md, "2026-12-06, fourth").
inline float* scratch_floats(int slot, size_t n) {
  thread_local std::unique_ptr<float[]> buf[2];
  thread_local size_t cap[2] = {0, 0};
  if (cap[slot] < n) {
    buf[slot].reset();  // the old one first: the two need not be resident at once
    buf[slot].reset(new float[n]);
    cap[slot] = n;
  }
  return buf[slot].get();
}

// x [m, k] in `dt` (fp32 or bf16) -> out [m, k] fp32, rows split over the pool.
inline void rows_to_fp32(DType dt, const void* x, int64_t m, int64_t k, float* out) {
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (dt == DType::BF16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + r * k;
        for (int64_t i = 0; i < k; ++i) out[r * k + i] = bits_to_float(static_cast<uint32_t>(src[i]) << 16);
      } else {
        std::copy_n(static_cast<const float*>(x) + r * k, k, out + r * k);
      }
    }
  });
}

// Groups of `col_blocks` column blocks (their weights stay in L2 across the row passes) handed to the threads
// of the pool by parallel_items (kernel_api.h), the rows of each in passes of `rows`:
// f(first block, end block, first row, rows in this pass).
template <typename F>
inline void over_blocks_and_rows(int64_t nblk, int64_t m, int64_t col_blocks, int rows, const F& f) {
  parallel_items((nblk + col_blocks - 1) / col_blocks, [&](int64_t i) {
    const int64_t b = i * col_blocks;
    for (int64_t r = 0; r < m; r += rows)
      f(b, std::min(nblk, b + col_blocks), r, static_cast<int>(std::min<int64_t>(rows, m - r)));
  });
}

// y (8 fp32 lanes) stored at `at` elements into `out`, in `dt`.
inline void store8(DType dt, void* out, int64_t at, __m256 y) {
  if (dt == DType::BF16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + at), to_bf16(y));
  else
    _mm256_storeu_ps(static_cast<float*>(out) + at, y);
}
#endif
