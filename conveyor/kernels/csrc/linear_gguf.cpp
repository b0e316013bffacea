// GGUF block-quantized weights used as a GGUF file ships them: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 inputs)
// and the k-quants Q4_K, Q5_K, Q6_K (super-blocks of 256), y [M, N] = x [M, K] @ W^T.
//
// Why: a one-stream decode step reads every weight once, so its time is the bytes of weights over the memory
// rate. A Q4_K_M 8B model is 4.9 GB as shipped and 16 GB dequantized to bf16; served as shipped, a token costs a
// third of the bytes. The ideas are llama.cpp's (ggml-cpu's quants and its x86 "repack" paths); the code is ours:
// - the activations are quantized per row to int8 in blocks (32 inputs for the 32-blocks, 256 for the k-quants)
//   with one fp32 scale each and integer sums per 16 inputs, so that a block's dot product is integer
//   arithmetic: AVX-512 VNNI `vpdpbusd` (u8 x s8, 4 products into each int32 lane), or AVX2 `vpmaddubsw` +
//   `vpmaddwd` where there is no VNNI (Zen 3); the per-block weight scales are applied in fp32;
// - the weights are repacked at load into a layout the SIMD lanes read contiguously: 16 output columns
//   interleaved, lane c of an int32 vector accumulating column c, so there is no horizontal sum anywhere; each
//   16-column group is one contiguous stream over K (what the hardware prefetchers follow best). The repacked
//   tensor has exactly the bytes of the GGUF tensor, rearranged (gguf_pack; gguf_unpack_rows undoes it).
//
// Layout of one 16-column group: its K blocks in order, each a chunk of 16 x (the type's block bytes). Within a
// chunk, with q[c][i] element i of column c's block as an unsigned integer (Q8_0: int8), a "quad" t the elements
// 4t..4t+3 of 16 columns as 64 bytes (byte 4c + kk = column c's element 4t + kk), and a "nibble vector" the
// 64 bytes whose low nibbles are one quad and high nibbles another:
//   32-blocks: d[16] fp16 | (Q4_1, Q5_1) m[16] fp16 | (Q5_*) 8 u64 high-bit masks, mask t bit 4c+kk = bit 4 of
//     q[c][4t+kk] | Q8_0: 8 quads; 4/5-bit: 4 nibble vectors, vector v = quads v (low) and v + 4 (high)
//   Q4_K: d[16] | dmin[16] | scales (192 bytes: below) | 8 sub-blocks of 32 x 4 nibble vectors as a 32-block's
//   Q5_K: as Q4_K, the high-bit masks (8 sub-blocks x 8 quads) between the scales and the nibbles
//   Q6_K: d[16] | sc[16 sub-blocks of 16][16] int8 | 8 32-element pieces x 8 quads x 2 masks (bits 4 and 5) |
//     8 pieces x 4 nibble vectors (low nibbles: the piece's first sub-block, high: its second)
//   k-quant scales: sc (6 bits) in 4 planes of 16 bytes (plane p byte c = low nibbles of sc[c][2p], sc[c][2p+1]),
//     m the same, then one u32 per column: bits 2j..2j+1 = sc[c][j] >> 4, bits 16 + 2j.. = m[c][j] >> 4
//
// Numerics (batch-invariant by construction: each output's operations do not depend on the other rows):
// activations: per row and block, amax = max |x|, d_x = amax / 127, q_x = clamp(rint(x * (127 / amax)), -127,
// 127) (0 where amax is 0). Per output column and block, an exact integer sum S (and for Q4_1/Q5_1/k-quant mins
// an exact integer sum T) is combined in fp32, blocks in K order, y starting at 0:
//   Q8_0, Q4_0, Q5_0: S = sum (q_w - offset) q_x (offset 0, 8, 16);  y = fma(d_w * d_x, S, y)
//   Q4_1, Q5_1: S = sum q_w q_x, T = sum q_x;  y = fma(d_w * d_x, S, y); y = fma(m_w * d_x, T, y)
//   Q4_K, Q5_K: S = sum_j sc_j sum_(i in j) q_w q_x, T = sum_j m_j sum_(i in j) q_x;  y = fma(d * d_x, S, y);
//     y = fma(-(dmin * d_x), T, y)
//   Q6_K: S = sum_j sc_j sum_(i in j) (q_w - 32) q_x;  y = fma(d * d_x, S, y)
// then one rounding to the output dtype. Every variant does these same operations, so they agree bit for bit;
// conveyor/model/gguf_weights.py emulates them in torch (the reference) and dequantizes as gguf-py does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel_api.h"
#include "vec_math.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define CONVEYOR_GGUF_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONVEYOR_GGUF_SIMD 256
#else
#define CONVEYOR_GGUF_SIMD 0
#endif

namespace conveyor {
namespace CONVEYOR_VARIANT {

namespace {

// ggml's type ids (GGMLQuantizationType)
enum : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int64_t kCols = 16;  // output columns per group (int32 lanes of a zmm)

// elements and bytes of one GGUF block of `type`; 0 for a type this file does not know
inline int block_elems(int type) {
  switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
  }
}
inline int block_bytes(int type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}
inline bool has_min(int type) { return type == Q4_1 || type == Q5_1; }
inline bool has_high_bit(int type) { return type == Q5_0 || type == Q5_1 || type == Q5_K; }

// Offsets inside one chunk (16 columns x one block).
struct ChunkLayout {
  int scales = 0;  // k-quants: the 192 bytes of sc/m planes; Q6_K: the int8 sc [16][16]
  int mins = 0;    // Q4_1/Q5_1: m[16]; k-quants: dmin[16]
  int masks = 0;   // high-bit masks
  int body = 0;    // quads (Q8_0) or nibble vectors
  int bytes = 0;
};
inline ChunkLayout layout_of(int type) {
  ChunkLayout l;
  switch (type) {
    case Q8_0: l.body = 32; break;
    case Q4_0: l.body = 32; break;
    case Q4_1: l.mins = 32; l.body = 64; break;
    case Q5_0: l.masks = 32; l.body = 96; break;
    case Q5_1: l.mins = 32; l.masks = 64; l.body = 128; break;
    case Q4_K: l.mins = 32; l.scales = 64; l.body = 256; break;
    case Q5_K: l.mins = 32; l.scales = 64; l.masks = 256; l.body = 768; break;
    case Q6_K: l.scales = 32; l.masks = 288; l.body = 1312; break;
    default: break;
  }
  l.bytes = static_cast<int>(kCols) * block_bytes(type);
  return l;
}

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t rd64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline void wr16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline void wr32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
inline void wr64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// One GGUF block taken apart: its integers (unsigned, before any offset; Q8_0: int8 as stored) and scales.
struct Block {
  uint8_t q[256];
  uint16_t d = 0, dm = 0;  // fp16 bits: d, and m (Q4_1/Q5_1) or dmin (k-quants)
  uint8_t sc[16] = {}, mn[8] = {};  // k-quants: 6-bit sc/m (Q4_K/Q5_K), int8 sc as stored (Q6_K)
};

// GGUF bytes -> Block (the element order of ggml-quants.c's dequantize_row_*)
void decode_block(int type, const uint8_t* b, Block& o) {
  switch (type) {
    case Q8_0:
      o.d = rd16(b);
      std::memcpy(o.q, b + 2, 32);
      return;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      o.d = rd16(b);
      int at = 2;
      if (has_min(type)) o.dm = rd16(b + 2), at = 4;
      uint32_t qh = 0;
      if (has_high_bit(type)) qh = rd32(b + at), at += 4;
      for (int j = 0; j < 16; ++j) {
        o.q[j] = b[at + j] & 15;
        o.q[j + 16] = b[at + j] >> 4;
      }
      if (qh)
        for (int i = 0; i < 32; ++i) o.q[i] |= ((qh >> i) & 1u) << 4;
      return;
    }
    case Q4_K: case Q5_K: {
      o.d = rd16(b);
      o.dm = rd16(b + 2);
      const uint8_t* s = b + 4;
      for (int j = 0; j < 4; ++j) {
        o.sc[j] = s[j] & 63;
        o.mn[j] = s[j + 4] & 63;
        o.sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        o.mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
      }
      const uint8_t* qh = type == Q5_K ? b + 16 : nullptr;
      const uint8_t* qs = b + (type == Q5_K ? 48 : 16);
      for (int i = 0; i < 4; ++i)  // 64 elements per 32 bytes: low nibbles, then high
        for (int l = 0; l < 32; ++l) {
          o.q[64 * i + l] = qs[32 * i + l] & 15;
          o.q[64 * i + 32 + l] = qs[32 * i + l] >> 4;
          if (qh) {
            o.q[64 * i + l] |= ((qh[l] >> (2 * i)) & 1) << 4;
            o.q[64 * i + 32 + l] |= ((qh[l] >> (2 * i + 1)) & 1) << 4;
          }
        }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      std::memcpy(o.sc, b + 192, 16);
      o.d = rd16(b + 208);
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t* a = ql + 64 * h;
          const uint8_t hb = qh[32 * h + l];
          o.q[128 * h + l] = (a[l] & 15) | ((hb & 3) << 4);
          o.q[128 * h + 32 + l] = (a[l + 32] & 15) | (((hb >> 2) & 3) << 4);
          o.q[128 * h + 64 + l] = (a[l] >> 4) | (((hb >> 4) & 3) << 4);
          o.q[128 * h + 96 + l] = (a[l + 32] >> 4) | (((hb >> 6) & 3) << 4);
        }
      return;
    }
    default: return;
  }
}

// Block -> GGUF bytes (decode_block's inverse)
void encode_block(int type, const Block& o, uint8_t* b) {
  switch (type) {
    case Q8_0:
      wr16(b, o.d);
      std::memcpy(b + 2, o.q, 32);
      return;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      wr16(b, o.d);
      int at = 2;
      if (has_min(type)) wr16(b + 2, o.dm), at = 4;
      if (has_high_bit(type)) {
        uint32_t qh = 0;
        for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>((o.q[i] >> 4) & 1) << i;
        wr32(b + at, qh);
        at += 4;
      }
      for (int j = 0; j < 16; ++j) b[at + j] = (o.q[j] & 15) | ((o.q[j + 16] & 15) << 4);
      return;
    }
    case Q4_K: case Q5_K: {
      wr16(b, o.d);
      wr16(b + 2, o.dm);
      uint8_t* s = b + 4;
      for (int j = 0; j < 4; ++j) {
        s[j] = (o.sc[j] & 63) | ((o.sc[j + 4] >> 4) << 6);
        s[j + 4] = (o.mn[j] & 63) | ((o.mn[j + 4] >> 4) << 6);
        s[j + 8] = (o.sc[j + 4] & 15) | ((o.mn[j + 4] & 15) << 4);
      }
      uint8_t* qh = type == Q5_K ? b + 16 : nullptr;
      uint8_t* qs = b + (type == Q5_K ? 48 : 16);
      if (qh) std::memset(qh, 0, 32);
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 32; ++l) {
          qs[32 * i + l] = (o.q[64 * i + l] & 15) | ((o.q[64 * i + 32 + l] & 15) << 4);
          if (qh)
            qh[l] |= (((o.q[64 * i + l] >> 4) & 1) << (2 * i)) | (((o.q[64 * i + 32 + l] >> 4) & 1) << (2 * i + 1));
        }
      return;
    }
    case Q6_K: {
      uint8_t* ql = b;
      uint8_t* qh = b + 128;
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          uint8_t* a = ql + 64 * h;
          const uint8_t* q = o.q + 128 * h;
          a[l] = (q[l] & 15) | ((q[64 + l] & 15) << 4);
          a[l + 32] = (q[32 + l] & 15) | ((q[96 + l] & 15) << 4);
          qh[32 * h + l] = ((q[l] >> 4) & 3) | (((q[32 + l] >> 4) & 3) << 2) | (((q[64 + l] >> 4) & 3) << 4) |
                           (((q[96 + l] >> 4) & 3) << 6);
        }
      std::memcpy(b + 192, o.sc, 16);
      wr16(b + 208, o.d);
      return;
    }
    default: return;
  }
}

// The nibble vectors of 32 elements e0..e31 (32-block, k-quant sub-block or Q6_K piece) of 16 columns:
// vector v byte 4c + kk = q[c][e0 + 4v + kk] (low) | q[c][e0 + 16 + 4v + kk] << 4.
inline void put_nibbles(uint8_t* dst, const Block* blk, int e0) {
  for (int v = 0; v < 4; ++v)
    for (int c = 0; c < 16; ++c)
      for (int kk = 0; kk < 4; ++kk)
        dst[64 * v + 4 * c + kk] = (blk[c].q[e0 + 4 * v + kk] & 15) | ((blk[c].q[e0 + 16 + 4 * v + kk] & 15) << 4);
}
inline void get_nibbles(const uint8_t* src, Block* blk, int e0) {
  for (int v = 0; v < 4; ++v)
    for (int c = 0; c < 16; ++c)
      for (int kk = 0; kk < 4; ++kk) {
        const uint8_t b = src[64 * v + 4 * c + kk];
        blk[c].q[e0 + 4 * v + kk] |= b & 15;
        blk[c].q[e0 + 16 + 4 * v + kk] |= b >> 4;
      }
}
// Mask t of 32 elements from e0: bit 4c + kk = bit `bit` of q[c][e0 + 4t + kk].
inline void put_masks(uint8_t* dst, const Block* blk, int e0, int bit, int stride_bytes) {
  for (int t = 0; t < 8; ++t) {
    uint64_t m = 0;
    for (int c = 0; c < 16; ++c)
      for (int kk = 0; kk < 4; ++kk) m |= static_cast<uint64_t>((blk[c].q[e0 + 4 * t + kk] >> bit) & 1) << (4 * c + kk);
    wr64(dst + t * stride_bytes, m);
  }
}
inline void get_masks(const uint8_t* src, Block* blk, int e0, int bit, int stride_bytes) {
  for (int t = 0; t < 8; ++t) {
    const uint64_t m = rd64(src + t * stride_bytes);
    for (int c = 0; c < 16; ++c)
      for (int kk = 0; kk < 4; ++kk) blk[c].q[e0 + 4 * t + kk] |= ((m >> (4 * c + kk)) & 1) << bit;
  }
}

// 16 decoded blocks (one per column) -> one chunk
void put_chunk(int type, const Block* blk, uint8_t* ch) {
  const ChunkLayout l = layout_of(type);
  std::memset(ch, 0, l.bytes);
  for (int c = 0; c < 16; ++c) wr16(ch + 2 * c, blk[c].d);
  if (l.mins)
    for (int c = 0; c < 16; ++c) wr16(ch + l.mins + 2 * c, blk[c].dm);
  switch (type) {
    case Q8_0:
      for (int t = 0; t < 8; ++t)
        for (int c = 0; c < 16; ++c) std::memcpy(ch + l.body + 64 * t + 4 * c, blk[c].q + 4 * t, 4);
      return;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1:
      if (l.masks) put_masks(ch + l.masks, blk, 0, 4, 8);
      put_nibbles(ch + l.body, blk, 0);
      return;
    case Q4_K: case Q5_K: {
      uint8_t* s = ch + l.scales;
      for (int p = 0; p < 4; ++p)
        for (int c = 0; c < 16; ++c) {
          s[16 * p + c] = (blk[c].sc[2 * p] & 15) | ((blk[c].sc[2 * p + 1] & 15) << 4);
          s[64 + 16 * p + c] = (blk[c].mn[2 * p] & 15) | ((blk[c].mn[2 * p + 1] & 15) << 4);
        }
      for (int c = 0; c < 16; ++c) {
        uint32_t hi = 0;
        for (int j = 0; j < 8; ++j)
          hi |= (static_cast<uint32_t>(blk[c].sc[j] >> 4) << (2 * j)) | (static_cast<uint32_t>(blk[c].mn[j] >> 4) << (16 + 2 * j));
        wr32(s + 128 + 4 * c, hi);
      }
      for (int j = 0; j < 8; ++j) {
        if (l.masks) put_masks(ch + l.masks + 64 * j, blk, 32 * j, 4, 8);
        put_nibbles(ch + l.body + 256 * j, blk, 32 * j);
      }
      return;
    }
    case Q6_K:
      for (int j = 0; j < 16; ++j)
        for (int c = 0; c < 16; ++c) ch[l.scales + 16 * j + c] = blk[c].sc[j];
      for (int p = 0; p < 8; ++p) {  // masks: piece p, quad t, plane: at 128 p + 16 t + 8 plane
        put_masks(ch + l.masks + 128 * p, blk, 32 * p, 4, 16);
        put_masks(ch + l.masks + 128 * p + 8, blk, 32 * p, 5, 16);
        put_nibbles(ch + l.body + 256 * p, blk, 32 * p);
      }
      return;
    default: return;
  }
}

// one chunk -> the block of column c
void get_chunk(int type, const uint8_t* ch, int c, Block& o) {
  const ChunkLayout l = layout_of(type);
  Block tmp[16];  // get_* fill all 16 columns; only column c is kept (a row lookup, not a hot path)
  for (auto& b : tmp) std::memset(b.q, 0, sizeof(b.q));
  o.d = rd16(ch + 2 * c);
  if (l.mins) o.dm = rd16(ch + l.mins + 2 * c);
  switch (type) {
    case Q8_0:
      for (int t = 0; t < 8; ++t) std::memcpy(o.q + 4 * t, ch + l.body + 64 * t + 4 * c, 4);
      return;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1:
      if (l.masks) get_masks(ch + l.masks, tmp, 0, 4, 8);
      get_nibbles(ch + l.body, tmp, 0);
      std::memcpy(o.q, tmp[c].q, 32);
      return;
    case Q4_K: case Q5_K: {
      const uint8_t* s = ch + l.scales;
      const uint32_t hi = rd32(s + 128 + 4 * c);
      for (int p = 0; p < 4; ++p) {
        o.sc[2 * p] = (s[16 * p + c] & 15) | (((hi >> (4 * p)) & 3) << 4);
        o.sc[2 * p + 1] = (s[16 * p + c] >> 4) | (((hi >> (4 * p + 2)) & 3) << 4);
        o.mn[2 * p] = (s[64 + 16 * p + c] & 15) | (((hi >> (16 + 4 * p)) & 3) << 4);
        o.mn[2 * p + 1] = (s[64 + 16 * p + c] >> 4) | (((hi >> (16 + 4 * p + 2)) & 3) << 4);
      }
      for (int j = 0; j < 8; ++j) {
        if (l.masks) get_masks(ch + l.masks + 64 * j, tmp, 32 * j, 4, 8);
        get_nibbles(ch + l.body + 256 * j, tmp, 32 * j);
      }
      std::memcpy(o.q, tmp[c].q, 256);
      return;
    }
    case Q6_K:
      for (int j = 0; j < 16; ++j) o.sc[j] = ch[l.scales + 16 * j + c];
      for (int p = 0; p < 8; ++p) {
        get_masks(ch + l.masks + 128 * p, tmp, 32 * p, 4, 16);
        get_masks(ch + l.masks + 128 * p + 8, tmp, 32 * p, 5, 16);
        get_nibbles(ch + l.body + 256 * p, tmp, 32 * p);
      }
      std::memcpy(o.q, tmp[c].q, 256);
      return;
    default: return;
  }
}

// gguf-py's dequantize_blocks, operation for operation in fp32 (the values the loader gives a dequantized file)
void dequant_block(int type, const Block& b, float* y) {
  const float d = fp16_to_fp32(b.d);
  switch (type) {
    case Q8_0:
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(b.q[i]));
      return;
    case Q4_0: case Q5_0: {
      const int off = type == Q4_0 ? 8 : 16;
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int>(b.q[i]) - off);
      return;
    }
    case Q4_1: case Q5_1: {
      const float m = fp16_to_fp32(b.dm);
      for (int i = 0; i < 32; ++i) {
        const float t = d * static_cast<float>(b.q[i]);
        y[i] = t + m;
      }
      return;
    }
    case Q4_K: case Q5_K: {
      const float dmin = fp16_to_fp32(b.dm);
      for (int j = 0; j < 8; ++j) {
        const float ds = d * static_cast<float>(b.sc[j]), dm = dmin * static_cast<float>(b.mn[j]);
        for (int i = 0; i < 32; ++i) {
          const float t = ds * static_cast<float>(b.q[32 * j + i]);
          y[32 * j + i] = t - dm;
        }
      }
      return;
    }
    case Q6_K:
      for (int j = 0; j < 16; ++j) {
        const float ds = d * static_cast<float>(static_cast<int8_t>(b.sc[j]));
        for (int i = 0; i < 16; ++i) y[16 * j + i] = ds * static_cast<float>(static_cast<int>(b.q[16 * j + i]) - 32);
      }
      return;
    default: return;
  }
}

}  // namespace

// GGUF rows src [n][k / qk blocks] -> the packed layout dst (the same number of bytes); n % 16 == 0.
void gguf_pack(int type, const uint8_t* src, uint8_t* dst, int64_t n, int64_t k) {
  const int qk = block_elems(type), bb = block_bytes(type);
  const int64_t nb = k / qk, row = nb * bb, cb = kCols * bb;
  parallel_for(0, n / kCols, 1, [&](int64_t g0, int64_t g1) {
    std::vector<Block> blk(kCols);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t c = 0; c < kCols; ++c) decode_block(type, src + (g * kCols + c) * row + b * bb, blk[c]);
        put_chunk(type, blk.data(), dst + (g * nb + b) * cb);
      }
  });
}

// rows [count] of the packed weight (n x k) back to GGUF bytes dst [count][k / qk blocks].
void gguf_unpack_rows(int type, const uint8_t* packed, int64_t n, int64_t k, const int64_t* rows, int64_t count,
                      uint8_t* dst) {
  (void)n;
  const int qk = block_elems(type), bb = block_bytes(type);
  const int64_t nb = k / qk, row = nb * bb, cb = kCols * bb;
  parallel_for(0, count, 4, [&](int64_t i0, int64_t i1) {
    Block blk;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = rows[i] / kCols, c = rows[i] % kCols;
      for (int64_t b = 0; b < nb; ++b) {
        get_chunk(type, packed + (g * nb + b) * cb, static_cast<int>(c), blk);
        encode_block(type, blk, dst + i * row + b * bb);
      }
    }
  });
}

// rows [count] of the packed weight dequantized as gguf-py does, into fp32 out [count][k].
void gguf_dequant_rows(int type, const uint8_t* packed, int64_t n, int64_t k, const int64_t* rows, int64_t count,
                       float* out) {
  (void)n;
  const int qk = block_elems(type), bb = block_bytes(type);
  const int64_t nb = k / qk, cb = kCols * bb;
  parallel_for(0, count, 4, [&](int64_t i0, int64_t i1) {
    Block blk;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = rows[i] / kCols, c = rows[i] % kCols;
      for (int64_t b = 0; b < nb; ++b) {
        get_chunk(type, packed + (g * nb + b) * cb, static_cast<int>(c), blk);
        dequant_block(type, blk, out + i * k + b * qk);
      }
    }
  });
}

namespace {

// One block of qk floats -> q (int8), its scale, and its sums per 16 (the numerics at the top). The SIMD paths
// do the same operations: amax (exact), d = amax / 127 and 127 / amax (IEEE divisions), x * (127 / amax) rounded
// to the nearest even integer (vcvtps2dq under the default rounding mode, as nearbyint).
inline void quantize_block(const float* xb, int64_t qk, int8_t* qb, float* d, int32_t* sums) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < qk; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
  const float amax = _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < qk; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + i), absmask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < qk; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *d = amax / 127.0f;
  for (int64_t s16 = 0; s16 < qk; s16 += 16) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + s16), _mm512_set1_ps(inv)));
    q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + s16), _mm512_cvtepi32_epi8(q));
    sums[s16 / 16] = _mm512_reduce_add_epi32(q);
#elif defined(__AVX2__)
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + s16), iv));
    __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + s16 + 8), iv));
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    q0 = _mm256_max_epi32(_mm256_min_epi32(q0, lim), nlim);
    q1 = _mm256_max_epi32(_mm256_min_epi32(q1, lim), nlim);
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  // 16 int16 in order
    const __m128i b8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + s16), b8);
    __m256i t = _mm256_add_epi32(q0, q1);
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    sums[s16 / 16] = _mm_cvtsi128_si32(t4);
#else
    int32_t acc = 0;
    for (int64_t i = s16; i < s16 + 16; ++i) {
      const float v = std::nearbyint(xb[i] * inv);  // round half to even (the default rounding mode)
      qb[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
      acc += qb[i];
    }
    sums[s16 / 16] = acc;
#endif
  }
}

}  // namespace

// x [m, k] (fp32 or bf16) -> per row: q int8 [k], d fp32 [k / qk], sums int32 [k / 16] (see the numerics above).
void gguf_quantize_rows(DType dt, const void* x, int64_t m, int64_t k, int64_t qk, int8_t* q, float* d,
                        int32_t* sums) {
  parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(dt == DType::BF16 ? static_cast<size_t>(k) : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = static_cast<const float*>(x) + r * k;
      if (dt == DType::BF16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + r * k;
        for (int64_t i = 0; i < k; ++i) row[i] = bits_to_float(static_cast<uint32_t>(src[i]) << 16);
        xr = row.data();
      }
      for (int64_t b = 0; b < k / qk; ++b)
        quantize_block(xr + b * qk, qk, q + r * k + b * qk, d + r * (k / qk) + b, sums + r * (k / 16) + b * (qk / 16));
    }
  });
}

#if CONVEYOR_GGUF_SIMD
namespace {

// ---- 16 int32 lanes (or 64 bytes) and 16 fp32 lanes: one zmm, or two ymm halves on AVX2 ------------------
#if CONVEYOR_GGUF_SIMD == 512
struct VI { __m512i v; };
struct VF { __m512 v; };
inline VI load64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VI zero_i() { return {_mm512_setzero_si512()}; }
inline VF zero_f() { return {_mm512_setzero_ps()}; }
inline VI low4(VI w) { return {_mm512_and_si512(w.v, _mm512_set1_epi8(15))}; }
inline VI high4(VI w) { return {_mm512_and_si512(_mm512_srli_epi16(w.v, 4), _mm512_set1_epi8(15))}; }
// bytes whose bit in `bits` is set get `val` added (the 5th and 6th bits of Q5/Q6 weights)
inline VI add_where(VI w, uint64_t bits, int val) {
  return {_mm512_mask_add_epi8(w.v, static_cast<__mmask64>(bits), w.v, _mm512_set1_epi8(static_cast<char>(val)))};
}
// acc + per lane sum of 4 products of unsigned weight bytes (0..63) with the 4 signed bytes `x4`
inline VI dot_u(VI acc, VI w, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))}; }
// the same for signed weight bytes: the sum plus kS8Bias times the sum of x4's bytes (the weights read as q + 128)
constexpr int32_t kS8Bias = 128;
inline VI dot_s(VI acc, VI w, int32_t x4) {
  return {_mm512_dpbusd_epi32(acc.v, _mm512_xor_si512(w.v, _mm512_set1_epi8(static_cast<char>(0x80))),
                              _mm512_set1_epi32(x4))};
}
// acc + per lane (lo16 * lo16 + hi16 * hi16) of a and the broadcast pair
inline VI dot_w(VI acc, VI a, int32_t pair) { return {_mm512_dpwssd_epi32(acc.v, a.v, _mm512_set1_epi32(pair))}; }
inline VI add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline VI sub(VI a, VI b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline VI mul(VI a, VI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline VI set1(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline VI u8_lanes(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline VI s8_lanes(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline VI u32_lanes(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VI srl(VI a, int n) { return {_mm512_srli_epi32(a.v, n)}; }
inline VI sll(VI a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline VI band(VI a, int32_t m) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
inline VI bor(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
inline VF half_lanes(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline VF to_f(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline VF mul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF neg(VF a) { return {_mm512_xor_ps(a.v, _mm512_set1_ps(-0.0f))}; }
inline VF fma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF set1f(float v) { return {_mm512_set1_ps(v)}; }
// 16 fp32 -> `dt` at out (bf16: round to nearest even, NaN a quiet NaN, as torch rounds)
inline void store16(DType dt, void* out, VF y) {
  if (dt == DType::F32) {
    _mm512_storeu_ps(out, y.v);
    return;
  }
  _mm256_storeu_si256(static_cast<__m256i*>(out), conveyor::bf16x16_round(y.v));  // as torch rounds (vec_math.h)
}
#else  // AVX2: two halves, columns 0-7 and 8-15
struct VI { __m256i a, b; };
struct VF { __m256 a, b; };
inline VI load64(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline VI zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VF zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VI low4(VI w) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(w.a, m), _mm256_and_si256(w.b, m)};
}
inline VI high4(VI w) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi16(w.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(w.b, 4), m)};
}
// 32 bits -> 32 bytes, 0xFF where the bit is set
inline __m256i expand_bits(uint32_t bits) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
  const __m256i sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), shuf);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}
inline VI add_where(VI w, uint64_t bits, int val) {
  const __m256i v = _mm256_set1_epi8(static_cast<char>(val));
  return {_mm256_add_epi8(w.a, _mm256_and_si256(expand_bits(static_cast<uint32_t>(bits)), v)),
          _mm256_add_epi8(w.b, _mm256_and_si256(expand_bits(static_cast<uint32_t>(bits >> 32)), v))};
}
// maddubs: u8 x s8 pairs into int16 (weights <= 63: 63 x 127 x 2 fits, no saturation), then pairs into int32
inline __m256i dot4(__m256i w, __m256i x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)); }
inline VI dot_u(VI acc, VI w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_add_epi32(acc.a, dot4(w.a, x)), _mm256_add_epi32(acc.b, dot4(w.b, x))};
}
// signed weights: |w| x (x with w's sign), which keeps maddubs' pairs within int16 (127 x 127 x 2)
constexpr int32_t kS8Bias = 0;
inline VI dot_s(VI acc, VI w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_add_epi32(acc.a, dot4(_mm256_sign_epi8(w.a, w.a), _mm256_sign_epi8(x, w.a))),
          _mm256_add_epi32(acc.b, dot4(_mm256_sign_epi8(w.b, w.b), _mm256_sign_epi8(x, w.b)))};
}
inline VI dot_w(VI acc, VI a, int32_t pair) {
  const __m256i p = _mm256_set1_epi32(pair);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(a.a, p)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(a.b, p))};
}
inline VI add(VI x, VI y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline VI sub(VI x, VI y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
inline VI mul(VI x, VI y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
inline VI set1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline VI u8_lanes(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline VI s8_lanes(const uint8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline VI u32_lanes(const uint8_t* p) { return load64(p); }
inline VI srl(VI x, int n) { return {_mm256_srli_epi32(x.a, n), _mm256_srli_epi32(x.b, n)}; }
inline VI sll(VI x, int n) { return {_mm256_slli_epi32(x.a, n), _mm256_slli_epi32(x.b, n)}; }
inline VI band(VI x, int32_t m) {
  const __m256i v = _mm256_set1_epi32(m);
  return {_mm256_and_si256(x.a, v), _mm256_and_si256(x.b, v)};
}
inline VI bor(VI x, VI y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
inline VF half_lanes(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline VF to_f(VI x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline VF mul(VF x, VF y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline VF neg(VF x) {
  const __m256 s = _mm256_set1_ps(-0.0f);
  return {_mm256_xor_ps(x.a, s), _mm256_xor_ps(x.b, s)};
}
inline VF fma(VF x, VF y, VF z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline VF set1f(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline __m128i bf16_of(__m256 v) {  // linear_common.h's to_bf16
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
inline void store16(DType dt, void* out, VF y) {
  if (dt == DType::F32) {
    _mm256_storeu_ps(static_cast<float*>(out), y.a);
    _mm256_storeu_ps(static_cast<float*>(out) + 8, y.b);
    return;
  }
  _mm_storeu_si128(static_cast<__m128i*>(out), bf16_of(y.a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + 8), bf16_of(y.b));
}
#endif

inline int32_t x4_at(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); return v; }

// Ask for the lines a distance past a chunk of `bytes` at p. Why: a decode step streams the weights from memory,
// and per 64 bytes of k-quant weights the kernel runs ~12 instructions (unpacking, dot products, high bits), so
// the out-of-order window holds fewer loads in flight than a bf16 kernel's; without asking ahead one Zen 5 core
// read Q6_K at 8 GB/s, bf16 at 21. The distance, measured on that machine (2 threads, a 4096 x 4096 weight cold,
// the fastest of many calls): 4 KiB for the 4- to 6-bit types (Q4_K 66 GB/s, Q6_K 62; 2 KiB and 16 KiB slower),
// 8 KiB for Q8_0, which consumes its bytes fastest (70 GB/s against 46-62 at 4 KiB). CONVEYOR_GGUF_PREFETCH=<bytes>
// sets one distance for every type (0: none), to measure.
inline int64_t prefetch_override() {
  static const int64_t d = [] {
    const char* e = std::getenv("CONVEYOR_GGUF_PREFETCH");
    return e ? std::atoll(e) : int64_t{-1};
  }();
  return d;
}
template <int T>
__attribute__((always_inline)) inline void prefetch_chunk(const uint8_t* p, int64_t bytes) {
  const int64_t forced = prefetch_override();
  const int64_t ahead = forced >= 0 ? forced : (T == Q8_0 ? 8192 : 4096);
  if (ahead <= 0) return;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + off), _MM_HINT_T0);
}

// The quantized activations of the rows of one pass.
struct Rows {
  const int8_t* q;    // [rows][k]
  const float* d;     // [rows][k / qk]
  const int32_t* s;   // [rows][k / 16]
  int64_t k, qk;
};

#if CONVEYOR_GGUF_SIMD == 512
constexpr int kMaxRows = 4;  // rows per pass over a group's weights
#else
constexpr int kMaxRows = 2;
#endif

// Independent accumulators per row: a dot product's latency (~5 cycles) is longer than its issue, and one chain
// per row left a one-row step waiting on it (hot in cache, 50 G weights/s on one Zen 5 core instead of ~100).
// Integer sums: how they are split does not change a bit of the result.
template <int R>
constexpr int chains() { return R == 1 ? 4 : 2; }

template <int R, int C>
inline VI sum_chains(const VI (&a)[R][C], int r) {
  VI s = a[r][0];
  for (int c = 1; c < C; ++c) s = add(s, a[r][c]);
  return s;
}

// R rows x one 16-column group of a 32-block type, over the whole K. w: the group's first chunk.
template <int T, int R>
void tile32(const Rows& x, const uint8_t* w, DType dt, void* out, int64_t ldo, size_t esize) {
  constexpr ChunkLayout l = [] {
    ChunkLayout c;
    switch (T) {
      case Q8_0: c.body = 32; break;
      case Q4_0: c.body = 32; break;
      case Q4_1: c.mins = 32; c.body = 64; break;
      case Q5_0: c.masks = 32; c.body = 96; break;
      default: c.mins = 32; c.masks = 64; c.body = 128; break;  // Q5_1
    }
    return c;
  }();
  constexpr int bb = T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 24;
  constexpr int cb = 16 * bb, C = chains<R>();
  constexpr int32_t offset = (T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0) + (T == Q8_0 ? kS8Bias : 0);
  const int64_t nb = x.k / 32, ks = x.k / 16;
  VF y[R];
  for (int r = 0; r < R; ++r) y[r] = zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* ch = w + b * cb;
    prefetch_chunk<T>(ch, cb);
    VI acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = zero_i();
    if (T == Q8_0) {
      for (int t = 0; t < 8; ++t) {
        const VI wv = load64(ch + l.body + 64 * t);
        for (int r = 0; r < R; ++r) acc[r][t % C] = dot_s(acc[r][t % C], wv, x4_at(x.q + r * x.k + 32 * b + 4 * t));
      }
    } else {
      for (int v = 0; v < 4; ++v) {
        const VI wv = load64(ch + l.body + 64 * v);
        VI lo = low4(wv), hi = high4(wv);
        if (l.masks) {
          lo = add_where(lo, rd64(ch + l.masks + 8 * v), 16);
          hi = add_where(hi, rd64(ch + l.masks + 8 * (v + 4)), 16);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + r * x.k + 32 * b;
          acc[r][(2 * v) % C] = dot_u(acc[r][(2 * v) % C], lo, x4_at(xq + 4 * v));
          acc[r][(2 * v + 1) % C] = dot_u(acc[r][(2 * v + 1) % C], hi, x4_at(xq + 16 + 4 * v));
        }
      }
    }
    const VF dw = half_lanes(ch);
    for (int r = 0; r < R; ++r) {
      const int32_t bsum = x.s[r * ks + 2 * b] + x.s[r * ks + 2 * b + 1];
      const float dx = x.d[r * nb + b];
      VI s = sum_chains(acc, r);
      if (offset) s = sub(s, set1(offset * bsum));
      y[r] = fma(mul(dw, set1f(dx)), to_f(s), y[r]);
      if (l.mins) y[r] = fma(mul(half_lanes(ch + l.mins), set1f(dx)), set1f(static_cast<float>(bsum)), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(dt, static_cast<char*>(out) + r * ldo * esize, y[r]);
}

// sc[c][2p] and sc[c][2p + 1] (6 bits) of a k-quant chunk's scale planes: plane `lo` (16 bytes), the columns'
// high bits `hi` (u32 lanes), `shift` = 4p (scales) or 16 + 4p (mins)
inline void six_bit_pair(const uint8_t* lo, VI hi, int shift, VI& a, VI& b) {
  const VI l = u8_lanes(lo);
  a = bor(band(l, 15), sll(band(srl(hi, shift), 3), 4));
  b = bor(srl(l, 4), sll(band(srl(hi, shift + 2), 3), 4));
}

// R rows x one 16-column group of Q4_K or Q5_K.
template <int T, int R>
void tile_k45(const Rows& x, const uint8_t* w, DType dt, void* out, int64_t ldo, size_t esize) {
  constexpr int cb = 16 * (T == Q4_K ? 144 : 176), C = chains<R>();
  constexpr int scales = 64, masks = 256, body = T == Q4_K ? 256 : 768;
  const int64_t nb = x.k / 256, ks = x.k / 16;
  VF y[R];
  for (int r = 0; r < R; ++r) y[r] = zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* ch = w + b * cb;
    prefetch_chunk<T>(ch, cb);
    const VI hi_bits = u32_lanes(ch + scales + 128);
    VI isum[R];
    for (int r = 0; r < R; ++r) isum[r] = zero_i();
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p, 2p + 1
      VI sc[2];
      six_bit_pair(ch + scales + 16 * p, hi_bits, 4 * p, sc[0], sc[1]);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        VI acc[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][c] = zero_i();
        for (int v = 0; v < 4; ++v) {
          const VI wv = load64(ch + body + 256 * j + 64 * v);
          VI lo = low4(wv), hi = high4(wv);
          if (T == Q5_K) {
            lo = add_where(lo, rd64(ch + masks + 64 * j + 8 * v), 16);
            hi = add_where(hi, rd64(ch + masks + 64 * j + 8 * (v + 4)), 16);
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xq = x.q + r * x.k + 256 * b + 32 * j;
            acc[r][(2 * v) % C] = dot_u(acc[r][(2 * v) % C], lo, x4_at(xq + 4 * v));
            acc[r][(2 * v + 1) % C] = dot_u(acc[r][(2 * v + 1) % C], hi, x4_at(xq + 16 + 4 * v));
          }
        }
        for (int r = 0; r < R; ++r) isum[r] = add(isum[r], mul(sum_chains(acc, r), sc[h]));
      }
    }
    // the mins: per lane, (m[2p], m[2p + 1]) as an int16 pair against each row's (sum of 2p, sum of 2p + 1)
    VI mp[4];
    for (int p = 0; p < 4; ++p) {
      VI m0, m1;
      six_bit_pair(ch + scales + 64 + 16 * p, hi_bits, 16 + 4 * p, m0, m1);
      mp[p] = bor(m0, sll(m1, 16));
    }
    const VF dw = half_lanes(ch), dmin = half_lanes(ch + 32);
    for (int r = 0; r < R; ++r) {
      const int32_t* s = x.s + r * ks + 16 * b;
      VI msum = zero_i();
      for (int p = 0; p < 4; ++p) {
        const int32_t b0 = s[4 * p] + s[4 * p + 1], b1 = s[4 * p + 2] + s[4 * p + 3];  // sums of sub-blocks 2p, 2p+1
        msum = dot_w(msum, mp[p], static_cast<int32_t>((static_cast<uint32_t>(b0) & 0xFFFF) |
                                                       (static_cast<uint32_t>(b1) << 16)));
      }
      const VF dx = set1f(x.d[r * nb + b]);
      y[r] = fma(mul(dw, dx), to_f(isum[r]), y[r]);
      y[r] = fma(neg(mul(dmin, dx)), to_f(msum), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(dt, static_cast<char*>(out) + r * ldo * esize, y[r]);
}

// R rows x one 16-column group of Q6_K.
template <int R>
void tile_q6k(const Rows& x, const uint8_t* w, DType dt, void* out, int64_t ldo, size_t esize) {
  constexpr int cb = 16 * 210, scales = 32, masks = 288, body = 1312, C = chains<R>() / 2;  // chains per half
  const int64_t nb = x.k / 256, ks = x.k / 16;
  VF y[R];
  for (int r = 0; r < R; ++r) y[r] = zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* ch = w + b * cb;
    prefetch_chunk<Q6_K>(ch, cb);
    VI isum[R];
    for (int r = 0; r < R; ++r) isum[r] = zero_i();
    for (int p = 0; p < 8; ++p) {  // 32 elements: sub-blocks 2p (low nibbles) and 2p + 1 (high)
      VI a0[R][C], a1[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) a0[r][c] = a1[r][c] = zero_i();
      for (int v = 0; v < 4; ++v) {
        const VI wv = load64(ch + body + 256 * p + 64 * v);
        const uint8_t* mk = ch + masks + 128 * p;
        VI lo = low4(wv), hi = high4(wv);
        lo = add_where(add_where(lo, rd64(mk + 16 * v), 16), rd64(mk + 16 * v + 8), 32);
        hi = add_where(add_where(hi, rd64(mk + 16 * (v + 4)), 16), rd64(mk + 16 * (v + 4) + 8), 32);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + r * x.k + 256 * b + 32 * p;
          a0[r][v % C] = dot_u(a0[r][v % C], lo, x4_at(xq + 4 * v));
          a1[r][v % C] = dot_u(a1[r][v % C], hi, x4_at(xq + 16 + 4 * v));
        }
      }
      const VI s0 = s8_lanes(ch + scales + 16 * (2 * p)), s1 = s8_lanes(ch + scales + 16 * (2 * p + 1));
      for (int r = 0; r < R; ++r) {
        const int32_t* s = x.s + r * ks + 16 * b + 2 * p;
        isum[r] = add(isum[r], mul(sub(sum_chains(a0, r), set1(32 * s[0])), s0));
        isum[r] = add(isum[r], mul(sub(sum_chains(a1, r), set1(32 * s[1])), s1));
      }
    }
    const VF dw = half_lanes(ch);
    for (int r = 0; r < R; ++r) y[r] = fma(mul(dw, set1f(x.d[r * nb + b])), to_f(isum[r]), y[r]);
  }
  for (int r = 0; r < R; ++r) store16(dt, static_cast<char*>(out) + r * ldo * esize, y[r]);
}

template <int R>
void tile(int type, const Rows& x, const uint8_t* w, DType dt, void* out, int64_t ldo, size_t esize) {
  switch (type) {
    case Q8_0: tile32<Q8_0, R>(x, w, dt, out, ldo, esize); break;
    case Q4_0: tile32<Q4_0, R>(x, w, dt, out, ldo, esize); break;
    case Q4_1: tile32<Q4_1, R>(x, w, dt, out, ldo, esize); break;
    case Q5_0: tile32<Q5_0, R>(x, w, dt, out, ldo, esize); break;
    case Q5_1: tile32<Q5_1, R>(x, w, dt, out, ldo, esize); break;
    case Q4_K: tile_k45<Q4_K, R>(x, w, dt, out, ldo, esize); break;
    case Q5_K: tile_k45<Q5_K, R>(x, w, dt, out, ldo, esize); break;
    case Q6_K: tile_q6k<R>(x, w, dt, out, ldo, esize); break;
    default: break;
  }
}

void tile_rows(int rows, int type, const Rows& x, const uint8_t* w, DType dt, void* out, int64_t ldo, size_t esize) {
  switch (rows) {
    case 1: tile<1>(type, x, w, dt, out, ldo, esize); break;
#if CONVEYOR_GGUF_SIMD == 512
    case 2: tile<2>(type, x, w, dt, out, ldo, esize); break;
    case 3: tile<3>(type, x, w, dt, out, ldo, esize); break;
    default: tile<4>(type, x, w, dt, out, ldo, esize); break;
#else
    default: tile<2>(type, x, w, dt, out, ldo, esize); break;
#endif
  }
}

constexpr int64_t kGroupsPerItem = 4;  // 16-column groups per work item: their weights stay in L2 across row passes

}  // namespace

// y [m, ldo] (its columns from the parts in order) = x [m, k] @ W^T, W the parts' packed weights (see the top).
void gguf_linear(const GGUFLinearArgs& a) {
  const int64_t m = a.m, k = a.k;
  // the activations quantized once per block size the parts need
  bool need[2] = {false, false};  // 32, 256
  for (int64_t p = 0; p < a.num_parts; ++p) need[block_elems(a.parts[p].type) == 256] = true;
  std::vector<int8_t> xq[2];
  std::vector<float> xd[2];
  std::vector<int32_t> xs[2];
  for (int i = 0; i < 2; ++i) {
    if (!need[i]) continue;
    const int64_t qk = i ? 256 : 32;
    xq[i].resize(static_cast<size_t>(m * k));
    xd[i].resize(static_cast<size_t>(m * (k / qk)));
    xs[i].resize(static_cast<size_t>(m * (k / 16)));
    gguf_quantize_rows(a.dt, a.x, m, k, qk, xq[i].data(), xd[i].data(), xs[i].data());
  }
  // work items: (part, first group), kGroupsPerItem groups each, parts in order
  std::vector<int64_t> item_part, item_group, col0(a.num_parts);
  int64_t at = 0;
  for (int64_t p = 0; p < a.num_parts; ++p) {
    col0[p] = at;
    at += a.parts[p].n;
    for (int64_t g = 0; g < a.parts[p].n / kCols; g += kGroupsPerItem) {
      item_part.push_back(p);
      item_group.push_back(g);
    }
  }
  const size_t esize = a.dt == DType::BF16 ? 2 : 4;
  parallel_items(static_cast<int64_t>(item_part.size()), [&](int64_t i) {
    const GGUFPart& part = a.parts[item_part[i]];
    const int qk = block_elems(part.type), big = qk == 256;
    const int64_t cb = kCols * block_bytes(part.type), nb = k / qk;
    const int64_t g0 = item_group[i], g1 = std::min(part.n / kCols, g0 + kGroupsPerItem);
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r));
      const Rows x{xq[big].data() + r * k, xd[big].data() + r * (k / qk), xs[big].data() + r * (k / 16), k, qk};
      for (int64_t g = g0; g < g1; ++g) {
        void* o = static_cast<char*>(a.out) + (r * a.ldo + col0[item_part[i]] + g * kCols) * esize;
        tile_rows(rows, part.type, x, part.w + g * nb * cb, a.dt, o, a.ldo, esize);
      }
    }
  });
}
#endif

void register_linear_gguf(Table& t) {
  t.gguf_pack = &gguf_pack;
  t.gguf_unpack_rows = &gguf_unpack_rows;
  t.gguf_dequant_rows = &gguf_dequant_rows;
  t.gguf_quantize_rows = &gguf_quantize_rows;
#if CONVEYOR_GGUF_SIMD
  t.gguf_linear = &gguf_linear;
#endif
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
