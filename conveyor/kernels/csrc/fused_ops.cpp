// Fused element-wise ops around the matmuls: each replaces 4-10 small torch ops (and their
// temporaries) per layer with one pass over the rows. Numerics follow the model's torch reference
// (conveyor/model/llama.py) step by step: fp32 inside, rounded to the model dtype where it rounds.

#include "kernel_api.h"
#include "vec_math.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace conveyor {
namespace CONVEYOR_VARIANT {
namespace {

#ifdef __AVX512F__
// 16 lanes of gv / (1 + exp_approx(-gv)), the same arithmetic as the scalar loop.
inline __m512 silu16(__m512 gv) {
  const __m512 e = conveyor::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
  return _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// bf16 rows through fp32 and back, rounding as `bf16(float)` does (vec_math.h)
inline __m512 bf16x16_to_f32(const bf16* p) {
  return conveyor::bf16x16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 bf16x16_to_f32_rounded(__m512 f) {  // f rounded to bf16 and widened again
  return conveyor::bf16x16_widen(conveyor::bf16x16_round(f));
}
#endif

using conveyor::exp_approx;

inline float f32(float x) { return x; }
inline float f32(bf16 x) { return static_cast<float>(x); }

// residual (optional) += x; x = weight * to_dtype(residual * rsqrt(mean(residual^2) + eps))
template <typename T>
void rms_norm_impl(T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps, T* out) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* src = xr;
      if (residual != nullptr) {
        T* rr = residual + r * dim;
        for (int64_t i = 0; i < dim; ++i) rr[i] = static_cast<T>(f32(rr[i]) + f32(xr[i]));
        src = rr;
      }
      // 16 partial sums (lane i % 16), then a fixed tree: one vector's chains instead of a scalar chain of
      // `dim` dependent adds, which took 3.4% of the 64-client SmolLM2 load (perf, Zen 4). The order is
      // fixed, so a row's result never depends on the batch.
      float part[16] = {};
      const int64_t body = dim - dim % 16;
      for (int64_t i0 = 0; i0 < body; i0 += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = f32(src[i0 + j]);
          part[j] += v * v;
        }
      for (int64_t i = body; i < dim; ++i) {
        const float v = f32(src[i]);
        part[i - body] += v * v;
      }
      for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) part[j] += part[j + w];
      const float ss = part[0];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const T normed = static_cast<T>(f32(src[i]) * inv);
        o[i] = static_cast<T>(f32(w[i]) * f32(normed));
      }
    }
  });
}

// q/k rows [T, H, D] rotated in place (HF's rotate-half): cos/sin [T, D/2] fp32.
template <typename T>
void rope_impl(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride_t, const float* cos,
               const float* sin) {
  const int64_t half = dim / 2;
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * stride_t + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(v[i]), x2 = f32(v[i + half]);
          v[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          v[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

// out [T, I] = silu(gate) * up, with gate_up [T, 2I]; silu rounds to the dtype first, as torch does.
template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t inter) {
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#ifdef __AVX512F__
      if constexpr (std::is_same<T, bf16>::value) {
        // bf16 in one pass, 16 lanes at a time, each rounding as the scalar loop below rounds (a 2048 x 8192
        // prefill chunk, Zen 5: 7.9 -> 5.8 ms, the output's page faults aside; the scalar bf16 conversions go)
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
          const __m512 act = bf16x16_to_f32_rounded(silu16(bf16x16_to_f32(g + i)));
          const __m512 prod = _mm512_mul_ps(act, bf16x16_to_f32(u + i));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), conveyor::bf16x16_round(prod));
        }
        for (; i < inter; ++i) {
          const float a = g[i] / (1.f + exp_approx(-f32(g[i])));
          o[i] = static_cast<T>(f32(static_cast<T>(a)) * f32(u[i]));
        }
        continue;
      }
#endif
      constexpr int64_t CH = 256;  // fp32 scratch keeps the exp loop free of conversions: it vectorises
      float act[CH];
      for (int64_t c = 0; c < inter; c += CH) {
        const int64_t n = std::min(CH, inter - c);
        int64_t i = 0;
        for (; i < n; ++i) act[i] = f32(g[c + i]);
        i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(act + i, silu16(_mm512_loadu_ps(act + i)));
#endif
        for (; i < n; ++i) act[i] = act[i] / (1.f + exp_approx(-act[i]));
        for (int64_t i = 0; i < n; ++i) o[c + i] = static_cast<T>(f32(static_cast<T>(act[i])) * f32(u[c + i]));
      }
    }
  });
}

// x: [T, dim] contiguous. With residual: residual += x, then out = norm(residual).
void rms_norm(DType dt, void* x, void* residual, const void* w, int64_t rows, int64_t dim, float eps, void* out) {
  if (dt == DType::F32) {
    rms_norm_impl<float>(static_cast<float*>(x), static_cast<float*>(residual), static_cast<const float*>(w), rows,
                         dim, eps, static_cast<float*>(out));
  } else {
    rms_norm_impl<bf16>(static_cast<bf16*>(x), static_cast<bf16*>(residual), static_cast<const bf16*>(w), rows, dim,
                        eps, static_cast<bf16*>(out));
  }
}

// x: [T, H, D] with D contiguous and heads adjacent (a column slice of the qkv output is fine).
void rope(DType dt, void* x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride_t, const float* cos,
          const float* sin) {
  if (dt == DType::F32) rope_impl<float>(static_cast<float*>(x), tokens, heads, dim, stride_t, cos, sin);
  else rope_impl<bf16>(static_cast<bf16*>(x), tokens, heads, dim, stride_t, cos, sin);
}

void silu_and_mul(DType dt, const void* gate_up, void* out, int64_t rows, int64_t inter) {
  if (dt == DType::F32) silu_mul_impl<float>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter);
  else silu_mul_impl<bf16>(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), rows, inter);
}

// Structured outputs: logits[rows[j], t] = -inf wherever bit t % 32 of words[j, t / 32] is 0 (tokens past the
// mask's end are banned too); row ids are checked by the caller. A plain scan: most words are all-ones or
// all-zeros, and the torch reference (unpack 32x, masked_fill) moves 32 bytes per logit where this touches
// each once.
void apply_token_bitmask(float* base, int64_t V, const uint32_t* words, int64_t W, int64_t R, const int64_t* row_ids) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < R; ++j) {
    float* row = base + row_ids[j] * V;
    const uint32_t* w = words + j * W;
    for (int64_t k = 0; k < W && k * 32 < V; ++k) {
      const uint32_t m = w[k];
      if (m == 0xffffffffu) continue;
      const int64_t t0 = k * 32, n = std::min<int64_t>(32, V - t0);
      for (int64_t b = 0; b < n; ++b)
        if (!((m >> b) & 1u)) row[t0 + b] = ninf;
    }
    for (int64_t t = W * 32; t < V; ++t) row[t] = ninf;
  }
}

}  // namespace

void register_fused_ops(Table& t) {
  t.rms_norm = &rms_norm;
  t.rope = &rope;
  t.silu_and_mul = &silu_and_mul;
  t.apply_token_bitmask = &apply_token_bitmask;
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
