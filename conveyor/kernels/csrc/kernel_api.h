// The boundary between the kernels and the torch bindings.
//
// Kernel files (paged_attention.cpp, fused_ops.cpp, linear_bf16.cpp, ...) are plain C++: raw pointers and
// sizes in, no torch header. setup.py compiles each of them once per instruction-set variant (generic,
// avx2, avx512, avx512bf16: see conveyor/kernels/variants.py), with that variant's -march flags and
// CONVEYOR_VARIANT set to its name, so every kernel lands in a namespace of its own
// (conveyor::avx2::rms_norm, ...) and the variants link into one module side by side. Each kernel file
// also defines `void register_<file>(Table&)` in that namespace, which stores its entry points in the
// variant's `Table`; variant_table.cpp calls them all. bindings.cpp (compiled once, with torch) checks
// the tensors, then calls through the Table of the variant chosen at load from the CPU's flags.
//
// Each variant is linked into a shared library of its own (conveyor/kernels/_cpu_<variant>.so), with hidden
// visibility: the inline functions and templates every variant instantiates (vec_math.h, <algorithm>,
// std::vector) then stay inside it. Linked into one library, the linker would keep one copy of each, maybe
// the AVX-512 one, for all variants: an illegal instruction on a CPU without it. The bindings dlopen the
// chosen variant's library and call its `conveyor_table()`.
//
// Parallel loops go through `parallel_for`, which the bindings implement with at::parallel_for.
//
// Adding a kernel file (e.g. sampler.cpp):
// 1. csrc/sampler.cpp: `#include "kernel_api.h"` and no torch header; everything inside
//    `namespace conveyor { namespace CONVEYOR_VARIANT { ... } }`; raw pointers and sizes in; `bf16` / `half`
//    (dtypes.h) for at::BFloat16 / at::Half; `parallel_for(begin, end, grain, lambda)` and
//    `get_num_threads()` for at::parallel_for / at::get_num_threads (no OpenMP pragmas); code that needs an
//    ISA extension under `#ifdef __AVX512F__` (etc.) with a portable path or a null entry beside it. It ends
//    with `void register_sampler(Table& t) { t.sampler = &sampler; }`: the name is register_<file stem>.
// 2. Table (below): a field for each entry point (an args struct when there are many parameters).
// 3. bindings.cpp: the op on tensors (TORCH_CHECKs, random numbers from torch's generator if it samples,
//    outputs allocated with at::empty), calling `table().sampler(...)`; `m.def(..., release())`.
// Nothing else: setup.py and the first-use build find the file by its name (kernel_files.h is generated).
// `pip install -e .` (or `python setup.py build_ext --inplace`) rebuilds; until then the edited sources are
// compiled on first use, since the installed build's source hash no longer matches.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "dtypes.h"

namespace conveyor {

enum class DType : int { F32 = 0, BF16 = 1, I8 = 2 };

// paged_attention: see paged_attention.cpp for the layouts.
struct AttentionArgs {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const half* k_scale;  // int8 caches: [blocks, Hkv, block_size]; else null
  const half* v_scale;
  const int32_t* block_tables;
  const int32_t* cu_q;
  const int32_t* ctx_lens;
  int64_t num_seqs, heads, kv_heads, head_dim, block_size, table_stride, q_stride_t, block_stride;
  float scale;
  DType dtype, cache_dtype;
};

struct WriteKVArgs {
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  const int64_t* slots;
  half* k_scale;
  half* v_scale;
  int64_t n, kv_heads, head_dim, block_size, block_stride, k_stride0, k_stride1, v_stride0, v_stride1;
  DType dtype, cache_dtype;
};

// lora_sgmv: see lora_sgmv.cpp. Per segment s (one adapter's rows): A_s [R_s, in] (the projections' A
// matrices stacked), Bt_s [R_s, out] (their B matrices transposed, block-diagonal) and the blocks of Bt_s
// that are not zero, each (first rank row, rank rows, first output column, output columns).
struct LoRAArgs {
  void* y;
  const void* x;
  int64_t in, out;
  const int64_t* work;  // per block of work: (first row, rows <= 4, segment)
  int64_t num_work;
  const void* const* a;
  const void* const* bt;
  const int64_t* rank;
  const int64_t* const* blocks;  // per segment: num_blocks[s] x (r0, rn, o0, on)
  const int64_t* num_blocks;
  DType dtype;
};

// gguf_linear (linear_gguf.cpp): GGUF block weights, several parts side by side in one output (q/k/v, gate/up
// fused, each part with its own GGUF type). part.w: that part's weights as gguf_pack lays them out, n % 16 == 0.
struct GGUFPart {
  int type;  // ggml's type id (Q4_0 = 2, ..., Q6_K = 14)
  int64_t n;
  const uint8_t* w;
};
struct GGUFLinearArgs {
  const void* x;  // [m, k], fp32 or bf16 (`dt`, also the output's)
  void* out;      // [m, ldo]: part p's columns after the earlier parts'
  const GGUFPart* parts;
  int64_t num_parts, m, k, ldo;
  DType dt;
};

// Every entry point of one variant. A null entry: not compiled into this variant (e.g. linear_bf16 needs
// AVX-512 BF16). Add a field here for a new kernel, set it in that file's register_<file>().
struct Table {
  const char* name = nullptr;
  void (*paged_attention)(const AttentionArgs&) = nullptr;
  void (*write_kv_cache)(const WriteKVArgs&) = nullptr;
  void (*rms_norm)(DType, void* x, void* residual, const void* w, int64_t rows, int64_t dim, float eps,
                   void* out) = nullptr;
  void (*rope)(DType, void* x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride_t, const float* cos,
               const float* sin) = nullptr;
  void (*silu_and_mul)(DType, const void* gate_up, void* out, int64_t rows, int64_t inter) = nullptr;
  void (*apply_token_bitmask)(float* logits, int64_t vocab, const uint32_t* words, int64_t num_words,
                              int64_t num_rows, const int64_t* row_ids) = nullptr;
  void (*linear_bf16)(const uint32_t* x, const uint16_t* packed, uint16_t* out, int64_t m, int64_t k,
                      int64_t n_blocks) = nullptr;
  // AMX tiles, on linear_bf16's packed layout; set only where the CPU has AMX and Linux grants the tile state
  void (*linear_amx)(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t m, int64_t k,
                     int64_t n_blocks) = nullptr;
  // AVX2 + FMA, on linear_bf16's packed layout: bf16 weights widened to fp32 in registers (linear_avx2.cpp)
  void (*linear_avx2)(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t m, int64_t k,
                      int64_t n_blocks) = nullptr;
  // int4 weights in groups of 32 inputs, AVX2 + FMA (linear_int4.cpp); dt: the activations' and output's dtype
  void (*linear_int4)(DType dt, const void* x, const uint8_t* q, const float* sz, void* out, int64_t m, int64_t k,
                      int64_t n) = nullptr;
  // int8 weights, one scale per output channel, AVX2 + FMA (linear_int8.cpp)
  void (*linear_int8)(DType dt, const void* x, const int8_t* q, const float* scale, void* out, int64_t m, int64_t k,
                      int64_t n) = nullptr;
  void (*lora_sgmv)(const LoRAArgs&) = nullptr;
  // --- GGUF block weights (linear_gguf.cpp) ---
  // GGUF rows [n][k] of `type` -> the kernel's layout (the same bytes, rearranged), and rows of it back
  void (*gguf_pack)(int type, const uint8_t* src, uint8_t* dst, int64_t n, int64_t k) = nullptr;
  void (*gguf_unpack_rows)(int type, const uint8_t* packed, int64_t n, int64_t k, const int64_t* rows, int64_t count,
                           uint8_t* dst) = nullptr;
  // rows of a packed weight dequantized as gguf-py does (embedding lookups), fp32 [count][k]
  void (*gguf_dequant_rows)(int type, const uint8_t* packed, int64_t n, int64_t k, const int64_t* rows, int64_t count,
                            float* out) = nullptr;
  // the activations as gguf_linear quantizes them: int8 [m][k], scales [m][k / qk], sums per 16 [m][k / 16]
  void (*gguf_quantize_rows)(DType dt, const void* x, int64_t m, int64_t k, int64_t qk, int8_t* q, float* d,
                             int32_t* sums) = nullptr;
  // AVX-512 VNNI or AVX2; null in the generic variant (the caller then dequantizes the weights at load)
  void (*gguf_linear)(const GGUFLinearArgs&) = nullptr;
  // --- end GGUF ---
  // W8A8 (linear_w8a8.cpp): int8 weights per output channel times int8 activations quantized per token on the fly,
  // exact int32 sums (AVX-512 VNNI, else AVX2); w packed [N/16][Kp/4][16][4], comp and sw [N]; x and out in dt
  // had > 0: x's rows Walsh-Hadamard transformed in blocks of `had` (a power of two >= 16 dividing k) first
  void (*linear_w8a8)(DType dt, const void* x, const int8_t* w, const int32_t* comp, const float* sw, void* out,
                      int64_t m, int64_t k, int64_t n, int64_t had) = nullptr;
  // the activations' quantization alone, as linear_w8a8 does it: q int8 [m, k], scale fp32 [m] (tests)
  void (*w8a8_quantize)(DType dt, const void* x, int64_t m, int64_t k, int64_t had, int8_t* q, float* scale) = nullptr;
  const char* w8a8_isa = nullptr;  // which instructions linear_w8a8 runs on here: "avx512-vnni" or "avx2"
  void (*sample_rows)(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                      const int64_t* top_k, const float* top_p, const float* min_p, const double* uniform,
                      int64_t* out) = nullptr;
  // per row of logits [rows, vocab]: its largest value and that value's first index (sampler.cpp)
  void (*argmax_rows)(const float* logits, int64_t rows, int64_t vocab, float* top, int64_t* idx) = nullptr;
};

// The thread pool, handed to each variant by the bindings when they load it (at::parallel_for and
// at::get_num_threads): the kernels run on torch's threads, `--threads` of them, as before the split.
using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);
struct Runtime {
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, void* ctx, ChunkFn fn);
  int (*num_threads)();
};

#ifdef CONVEYOR_VARIANT  // a kernel file, compiled once per variant
namespace CONVEYOR_VARIANT {

extern const Runtime* runtime;  // set by table()

// at::parallel_for's contract: f(begin, end) over chunks of [begin, end), at least `grain` long.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  runtime->parallel_for(begin, end, grain, const_cast<void*>(static_cast<const void*>(&f)),
                        [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); });
}

inline int get_num_threads() { return runtime->num_threads(); }

// f(i) for every item i in [0, items), over torch's pool: each thread starts on an equal contiguous share (so
// it streams its weights in order, which the hardware prefetcher needs), and a thread that finishes its share
// takes the next items of the others' shares. Why not a static share alone: a one-row step streams its
// weights from memory, and on a shared 2-core VM one thread regularly starts late (woken from sleep after the
// Python between two linears) or streams slower; the other then waited at the region's end, 11% of a
// one-stream bf16 step on a Zen 4 (perf). Why not one shared counter: two threads taking alternate small
// items each stream a broken sequence, and the int4 step got ~10% slower. Which thread runs an item never
// changes its result.
template <typename F>
inline void parallel_items(int64_t items, const F& f) {
  const int64_t nt = std::min<int64_t>(get_num_threads(), items);
  if (nt <= 1) {
    for (int64_t i = 0; i < items; ++i) f(i);
    return;
  }
  struct alignas(64) Next {  // one cache line each: the owner's fetch_add does not bounce the others'
    std::atomic<int64_t> v;
  };
  std::unique_ptr<Next[]> next(new Next[nt]);
  for (int64_t t = 0; t < nt; ++t) next[t].v.store(items * t / nt, std::memory_order_relaxed);
  parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t v = 0; v < nt; ++v) {  // its own share, then what is left of the others'
        const int64_t u = (t + v) % nt, end = items * (u + 1) / nt;
        for (int64_t i = next[u].v.fetch_add(1, std::memory_order_relaxed); i < end;
             i = next[u].v.fetch_add(1, std::memory_order_relaxed))
          f(i);
      }
  });
}

// This variant's entry points; `rt` is kept for parallel_for. Defined in variant_table.cpp.
const Table* table(const Runtime* rt);

}  // namespace CONVEYOR_VARIANT
#endif

}  // namespace conveyor
