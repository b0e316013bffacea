// bf16 and fp16 storage types with the same conversions as torch's c10::BFloat16 and c10::Half (round to
// nearest even; NaN stays NaN), so that the kernels, compiled without torch's headers, round exactly as
// they did with them. Layout: one uint16_t, as torch stores them.
#pragma once

#include <cstdint>
#include <cstring>

namespace conveyor {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

struct bf16 {
  uint16_t x;
  bf16() = default;
  explicit bf16(float f) {
    if (f != f) {
      x = 0x7FC0;  // c10: a quiet NaN
    } else {
      const uint32_t u = float_to_bits(f);
      x = static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
    }
  }
  operator float() const { return bits_to_float(static_cast<uint32_t>(x) << 16); }
};

// IEEE fp16 <-> fp32 (the fp16 library's algorithms, which c10::Half uses).
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = bits_to_float(0x7800000u);
  const float normalized = bits_to_float((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = bits_to_float((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result = sign | (two_w < denormalized_cutoff ? float_to_bits(denormalized) : float_to_bits(normalized));
  return bits_to_float(result);
}

inline uint16_t fp32_to_fp16(float f) {
  const float scale_to_inf = bits_to_float(0x77800000u);
  const float scale_to_zero = bits_to_float(0x08800000u);
  float base = (f < 0 ? -f : f) * scale_to_inf;
  base *= scale_to_zero;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

struct half {
  uint16_t x;
  half() = default;
  explicit half(float f) : x(fp32_to_fp16(f)) {}
  operator float() const { return fp16_to_fp32(x); }
};

static_assert(sizeof(bf16) == 2 && sizeof(half) == 2, "bf16 and half must be stored as torch stores them");

}  // namespace conveyor
