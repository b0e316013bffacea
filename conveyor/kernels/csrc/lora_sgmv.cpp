// LoRA's low-rank products for a whole step in one call per linear: S-LoRA / Punica's SGMV on the CPU.
//
// y[rows of segment s] += (x[rows] @ At_s) @ Bt_s for every segment s of the step (one adapter's rows),
// with At_s [in, R] and Bt_s [R, out] (the adapter's A and scaled B, transposed). Why compiled: in torch
// each segment costs two small matmuls, ~20 us each in bf16 whatever their size, and a step with 16
// adapters has 16 segments in each of a model's 120 linears: ~80 ms of dispatch for a few ms of math.
// Here one call does every segment, in blocks of up to 4 rows of one segment (each weight loaded once
// serves the block), each block one thread's work, start to end, in fp32:
//   shrink  t[j][r] += x[j][k] * At[k][r]      (k outer, r inner: contiguous, vectorized without reordering sums)
//   expand  acc[j][o] += t[j][r] * Bt[r][o]     (r outer, o inner: the same)
// and y = y + acc rounded once. Every row's sums run in the same order whatever block it is in, so a
// row's result depends only on its own inputs and its adapter: batch-invariant by construction.

#include "kernel_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

constexpr int kRows = 4;      // rows per register block: each weight loaded once serves 4 rows

// y[o] = round(y[o] + acc[o]) for a row: rounding to bf16 in integer ops (round to nearest even, as
// torch's BFloat16 does for finite values), which vectorizes; torch's scalar conversion was most of
// the kernel's time.
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

// rows [row0, row0 + NB) of one segment: t = x At (fp32), then y += t Bt. Both loops keep their
// accumulators in registers: 16 rank columns x NB rows for the shrink, 64 output columns x NB rows for
// the expand, each weight vector loaded once for the NB rows (a tail narrower than a tile takes the
// plain loop). Every sum runs over k (shrink) or r (expand) in order, whichever path: batch-invariant.
template <typename T, int NB>
void rows_block(T* __restrict y, const T* __restrict x, int64_t row0, int64_t in, int64_t out,
                const T* __restrict a, const T* __restrict b, int64_t r_n, float* __restrict t) {
  constexpr int RT = 16, OT = 64;
  for (int64_t r0 = 0; r0 < r_n; r0 += RT) {
    const int64_t rn = std::min<int64_t>(RT, r_n - r0);
    float acc[NB][RT] = {};
    for (int64_t k = 0; k < in; ++k) {
      const T* ak = a + k * r_n + r0;
      float xv[NB];
      for (int j = 0; j < NB; ++j) xv[j] = load(x + (row0 + j) * in, k);
      if (rn == RT) {
#pragma omp simd
        for (int r = 0; r < RT; ++r) {
          const float w = load(ak, r);
          for (int j = 0; j < NB; ++j) acc[j][r] += xv[j] * w;
        }
      } else {
        for (int r = 0; r < rn; ++r) {
          const float w = load(ak, r);
          for (int j = 0; j < NB; ++j) acc[j][r] += xv[j] * w;
        }
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < rn; ++r) t[j * r_n + r0 + r] = acc[j][r];
  }
  for (int64_t o0 = 0; o0 < out; o0 += OT) {
    const int64_t on = std::min<int64_t>(OT, out - o0);
    float acc[NB][OT] = {};
    for (int64_t r = 0; r < r_n; ++r) {
      float tv[NB];
      for (int j = 0; j < NB; ++j) tv[j] = t[j * r_n + r];
      const T* br = b + r * out + o0;
      if (on == OT) {
#pragma omp simd
        for (int o = 0; o < OT; ++o) {
          const float w = load(br, o);
          for (int j = 0; j < NB; ++j) acc[j][o] += tv[j] * w;
        }
      } else {
        for (int o = 0; o < on; ++o) {
          const float w = load(br, o);
          for (int j = 0; j < NB; ++j) acc[j][o] += tv[j] * w;
        }
      }
    }
    for (int j = 0; j < NB; ++j) add_row(y + (row0 + j) * out + o0, acc[j], on);
  }
}

// work: (first row, number of rows <= kRows, segment) per block of a segment's rows
template <typename T>
void sgmv(T* y, const T* x, int64_t in, int64_t out, const int64_t* work, int64_t n, const void* const* at,
          const void* const* bt, const int64_t* rank, int64_t num_segments) {
  int64_t r_max = 0;
  for (int64_t s = 0; s < num_segments; ++s) r_max = std::max(r_max, rank[s]);
  parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(kRows * r_max);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row0 = work[3 * i], nb = work[3 * i + 1], s = work[3 * i + 2];
      const T* a = static_cast<const T*>(at[s]);
      const T* b = static_cast<const T*>(bt[s]);
      const int64_t r_n = rank[s];
      switch (nb) {
        case 4: rows_block<T, 4>(y, x, row0, in, out, a, b, r_n, t.data()); break;
        case 3: rows_block<T, 3>(y, x, row0, in, out, a, b, r_n, t.data()); break;
        case 2: rows_block<T, 2>(y, x, row0, in, out, a, b, r_n, t.data()); break;
        default: rows_block<T, 1>(y, x, row0, in, out, a, b, r_n, t.data()); break;
      }
    }
  });
}

}  // namespace

// y [n, out] += per block of work (first row, rows <= 4, segment) of the segments' at [in, R_s] and bt
// [R_s, out], all in `dt` (float32 or bfloat16); the bindings check the shapes and build `work`.
void lora_sgmv(DType dt, void* y, const void* x, int64_t in, int64_t out, const int64_t* work, int64_t num_work,
               const void* const* at, const void* const* bt, const int64_t* rank, int64_t num_segments) {
  if (dt == DType::F32)
    sgmv<float>(static_cast<float*>(y), static_cast<const float*>(x), in, out, work, num_work, at, bt, rank,
                num_segments);
  else
    sgmv<bf16>(static_cast<bf16*>(y), static_cast<const bf16*>(x), in, out, work, num_work, at, bt, rank,
               num_segments);
}

void register_lora_sgmv(Table& t) { t.lora_sgmv = &lora_sgmv; }

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
