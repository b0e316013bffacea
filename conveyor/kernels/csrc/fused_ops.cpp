// Fused element-wise ops around the matmuls: each replaces 4-10 small torch ops (and their
// temporaries) per layer with one pass over the rows. Numerics follow the model's torch reference
// (conveyor/model/llama.py) step by step: fp32 inside, rounded to the model dtype where it rounds.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec_math.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

#ifdef __AVX512F__
// 16 lanes of gv / (1 + exp_approx(-gv)), the same arithmetic as the scalar loop.
inline __m512 silu16(__m512 gv) {
  const __m512 e = conveyor::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
  return _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

using conveyor::exp_approx;

inline float f32(float x) { return x; }
inline float f32(at::BFloat16 x) { return static_cast<float>(x); }

// residual (optional) += x; x = weight * to_dtype(residual * rsqrt(mean(residual^2) + eps))
template <typename T>
void rms_norm_impl(T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* src = xr;
      if (residual != nullptr) {
        T* rr = residual + r * dim;
        for (int64_t i = 0; i < dim; ++i) rr[i] = static_cast<T>(f32(rr[i]) + f32(xr[i]));
        src = rr;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = f32(src[i]);
        ss += v * v;
      }
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
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
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

}  // namespace

// x: [T, dim] contiguous. With residual: residual += x, then out = norm(residual). Returns out.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type());
  auto out = torch::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  if (residual.has_value()) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                         weight.data_ptr<float>(), rows, dim, static_cast<float>(eps), out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(),
                                residual ? residual->data_ptr<at::BFloat16>() : nullptr,
                                weight.data_ptr<at::BFloat16>(), rows, dim, static_cast<float>(eps),
                                out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "rms_norm: dtype not supported");
  }
  return out;
}

// x: [T, H, D] with D contiguous and heads adjacent (a column slice of the qkv output is fine).
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2));
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat);
  if (x.scalar_type() == at::kFloat) {
    rope_impl<float>(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0), cos.data_ptr<float>(),
                     sin.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    rope_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), x.size(2), x.stride(0),
                            cos.data_ptr<float>(), sin.data_ptr<float>());
  } else {
    TORCH_CHECK(false, "rope_: dtype not supported");
  }
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous());
  const int64_t inter = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_impl<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
  } else {
    TORCH_CHECK(false, "silu_and_mul: dtype not supported");
  }
  return out;
}

// Structured outputs: logits[rows[j], t] = -inf wherever bit t % 32 of bits[j, t / 32] is 0 (tokens past the
// mask's end are banned too). logits: [B, V] float32 contiguous; bits: [R, W] int32; rows: [R] int64.
// A plain scan: most words are all-ones or all-zeros, and the torch reference (unpack 32x, masked_fill)
// moves 32 bytes per logit where this touches each once.
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bits, torch::Tensor rows) {
  TORCH_CHECK(logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.dim() == 2);
  TORCH_CHECK(bits.is_contiguous() && bits.scalar_type() == at::kInt && rows.scalar_type() == at::kLong);
  const int64_t V = logits.size(1), W = bits.size(1), R = bits.size(0);
  TORCH_CHECK(rows.numel() == R);
  const float ninf = -std::numeric_limits<float>::infinity();
  float* base = logits.data_ptr<float>();
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < R; ++j) {
    TORCH_CHECK(row_ids[j] >= 0 && row_ids[j] < logits.size(0));
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
