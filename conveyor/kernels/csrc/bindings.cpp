// The Python module: torch tensors in, checks, then a call through the chosen variant's Table.
//
// The only file that includes torch's headers (the slow part of the build), so it is compiled once, for the
// baseline x86-64 ISA. Installed builds: the kernels live in one library per instruction-set variant
// (kernel_api.h), and conveyor/kernels/__init__.py picks one from the CPU's flags (or CONVEYOR_CPU_VARIANT)
// and hands its path to load_variant() right after import. The first-use JIT build (-march=native) compiles
// this file with the kernels into one module and defines CONVEYOR_BUILTIN_VARIANT: that variant is used.
// Only the headers it uses, not <torch/extension.h>: that one alone is ~22 s of compiler time, these ~8 s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernel_api.h"

#ifdef CONVEYOR_BUILTIN_VARIANT
namespace conveyor {
namespace CONVEYOR_BUILTIN_VARIANT {
const Table* table(const Runtime* rt);
}  // namespace CONVEYOR_BUILTIN_VARIANT
}  // namespace conveyor
#endif

namespace {

using conveyor::DType;
using conveyor::Table;

constexpr int64_t MAX_ROWS = 64;  // paged_attention.cpp: query rows per work item (GQA group bound)
constexpr int64_t HEAD_DIMS[] = {32, 64, 80, 96, 128, 256};  // compiled in (KERNEL_HEAD_DIMS in attention.py)

void parallel_for_impl(int64_t begin, int64_t end, int64_t grain, void* ctx, conveyor::ChunkFn fn) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
}
int num_threads_impl() { return at::get_num_threads(); }

// How many distinct threads of the pool ran chunks of a `parallel_for` over n items: the kernels' loop, so a
// build whose loop runs serially (compiled without OpenMP: the pragma is dropped silently) answers 1.
int64_t parallel_threads_used(int64_t n) {
  std::mutex m;
  std::vector<int> seen;
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> g(m);
    const int t = at::get_thread_num();
    if (std::find(seen.begin(), seen.end(), t) == seen.end()) seen.push_back(t);
  });
  return static_cast<int64_t>(seen.size());
}
const conveyor::Runtime kRuntime{&parallel_for_impl, &num_threads_impl};

#ifdef CONVEYOR_BUILTIN_VARIANT
const Table* g_table = conveyor::CONVEYOR_BUILTIN_VARIANT::table(&kRuntime);
#else
const Table* g_table = nullptr;  // until load_variant()
#endif

const Table& table() {
  TORCH_CHECK(g_table != nullptr, "conveyor kernels: no variant loaded (conveyor.kernels.load() loads one)");
  return *g_table;
}

// dlopen the library of one variant (RTLD_LOCAL: its symbols stay its own) and run its ops from now on.
// Libraries stay loaded: switching back (tests compare variants) finds them in `loaded`.
std::string load_variant(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, const Table*> loaded;
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded.find(path);
  if (it == loaded.end()) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(handle != nullptr, "cannot load kernel variant ", path, ": ", dlerror());
    using Entry = const Table* (*)(const conveyor::Runtime*);
    auto entry = reinterpret_cast<Entry>(dlsym(handle, "conveyor_table"));
    TORCH_CHECK(entry != nullptr, path, " has no conveyor_table()");
    it = loaded.emplace(path, entry(&kRuntime)).first;
  }
  g_table = it->second;
  return table().name;
}

#ifdef CONVEYOR_SOURCE_HASH
std::string source_hash() { return CONVEYOR_SOURCE_HASH; }
#endif

std::string variant() { return g_table ? table().name : ""; }

DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kChar: return DType::I8;
    default: TORCH_CHECK(false, what, ": dtype ", t.scalar_type(), " is not supported");
  }
  return DType::F32;
}

// out, q: [T, H, D] contiguous; k_cache: [blocks, Hkv, D, block_size] (K transposed within a block, so a
// tile of keys is contiguous for every d); v_cache: [blocks, Hkv, block_size, D];
// block_tables: int32 [S, max_blocks]; cu_q: int32 [S + 1]; ctx_lens: int32 [S].
// int8 caches come with k_scale/v_scale: fp16 [blocks, Hkv, block_size].
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor cu_q, at::Tensor ctx_lens, double scale,
                     c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(), "q/out: [T, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == v_cache.size(0));
  const bool q8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((q8 || q.scalar_type() == k_cache.scalar_type()) && out.scalar_type() == q.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "q/out/cache dtypes");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_attention: dtype ", q.scalar_type(), " is not supported");
  TORCH_CHECK(!q8 || (k_scale && v_scale && k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf &&
                      k_scale->is_contiguous() && v_scale->is_contiguous() &&
                      k_scale->numel() == k_cache.size(0) * k_cache.size(1) * k_cache.size(3) &&
                      v_scale->numel() == k_scale->numel()), "int8 caches need fp16 scales [blocks, Hkv, block_size]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && cu_q.scalar_type() == at::kInt &&
              ctx_lens.scalar_type() == at::kInt && block_tables.is_contiguous());
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && q.size(1) / k_cache.size(1) <= MAX_ROWS, "GQA group too large");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && v_cache.size(3) == q.size(2));
  TORCH_CHECK(std::find(std::begin(HEAD_DIMS), std::end(HEAD_DIMS), q.size(2)) != std::end(HEAD_DIMS),
              "paged_attention: head_dim ", q.size(2), " is not compiled in");
  conveyor::AttentionArgs a;
  a.out = out.data_ptr();
  a.q = q.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.k_scale = q8 ? reinterpret_cast<const conveyor::half*>(k_scale->data_ptr<at::Half>()) : nullptr;
  a.v_scale = q8 ? reinterpret_cast<const conveyor::half*>(v_scale->data_ptr<at::Half>()) : nullptr;
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.cu_q = cu_q.data_ptr<int32_t>();
  a.ctx_lens = ctx_lens.data_ptr<int32_t>();
  a.num_seqs = ctx_lens.size(0);
  a.heads = q.size(1);
  a.kv_heads = k_cache.size(1);
  a.head_dim = q.size(2);
  a.block_size = k_cache.size(3);
  a.table_stride = block_tables.size(1);
  a.q_stride_t = q.stride(0);
  a.block_stride = k_cache.stride(0);
  a.scale = static_cast<float>(scale);
  a.dtype = dtype_of(q, "paged_attention");
  a.cache_dtype = dtype_of(k_cache, "paged_attention");
  table().paged_attention(a);
}

// Scatter this step's K/V [T, Hkv, D] into their slots (slot = block * block_size + offset).
void write_kv_cache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slots, c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous());
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16,
              "write_kv_cache: dtype ", k.scalar_type(), " is not supported");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  if (q8) {
    TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf);
  } else {
    TORCH_CHECK(k.scalar_type() == k_cache.scalar_type(), "write_kv_cache: K/V and cache dtypes differ");
  }
  conveyor::WriteKVArgs a;
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.slots = slots.data_ptr<int64_t>();
  a.k_scale = q8 ? reinterpret_cast<conveyor::half*>(k_scale->data_ptr<at::Half>()) : nullptr;
  a.v_scale = q8 ? reinterpret_cast<conveyor::half*>(v_scale->data_ptr<at::Half>()) : nullptr;
  a.n = k.size(0);
  a.kv_heads = k.size(1);
  a.head_dim = k.size(2);
  a.block_size = k_cache.size(3);
  a.block_stride = k_cache.stride(0);
  a.k_stride0 = k.stride(0);
  a.k_stride1 = k.stride(1);
  a.v_stride0 = v.stride(0);
  a.v_stride1 = v.stride(1);
  a.dtype = dtype_of(k, "write_kv_cache");
  a.cache_dtype = dtype_of(k_cache, "write_kv_cache");
  table().write_kv_cache(a);
}

DType float_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": dtype not supported");
  return t.scalar_type() == at::kFloat ? DType::F32 : DType::BF16;
}

// x: [T, dim] contiguous. With residual: residual += x, then out = norm(residual). Returns out.
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type());
  const DType dt = float_dtype(x, "rms_norm");
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type());
  }
  table().rms_norm(dt, x.data_ptr(), residual ? residual->data_ptr() : nullptr, weight.data_ptr(), rows, dim,
                    static_cast<float>(eps), out.data_ptr());
  return out;
}

// x: [T, H, D] with D contiguous and heads adjacent (a column slice of the qkv output is fine).
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2));
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat);
  const DType dt = float_dtype(x, "rope_");
  table().rope(dt, x.data_ptr(), x.size(0), x.size(1), x.size(2), x.stride(0), cos.data_ptr<float>(),
                sin.data_ptr<float>());
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous());
  const DType dt = float_dtype(gate_up, "silu_and_mul");
  const int64_t inter = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());
  table().silu_and_mul(dt, gate_up.data_ptr(), out.data_ptr(), rows, inter);
  return out;
}

// logits: [B, V] float32 contiguous; bits: [R, W] int32; rows: [R] int64 (see fused_ops.cpp).
void apply_token_bitmask_(at::Tensor logits, at::Tensor bits, at::Tensor rows) {
  TORCH_CHECK(logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.dim() == 2);
  TORCH_CHECK(bits.is_contiguous() && bits.scalar_type() == at::kInt && rows.scalar_type() == at::kLong);
  const int64_t V = logits.size(1), W = bits.size(1), R = bits.size(0);
  TORCH_CHECK(rows.numel() == R && rows.is_contiguous());
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < R; ++j) TORCH_CHECK(row_ids[j] >= 0 && row_ids[j] < logits.size(0));
  table().apply_token_bitmask(logits.data_ptr<float>(), V, reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>()),
                               W, R, row_ids);
}

bool linear_bf16_available() { return table().linear_bf16 != nullptr; }

at::Tensor linear_bf16_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "linear_bf16_pack: a 2-D bf16 weight is needed");
  int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 2 == 0, "linear_bf16_pack: N must be a multiple of 16 and K even, got ", n, "x", k);
  return w.contiguous().view({n / 16, 16, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// The checks both bf16 linears share (x [M, K] bf16; a weight from linear_bf16_pack; K a multiple of
// `k_multiple`), `x` made contiguous, and their output [M, N].
at::Tensor packed_linear_out(const char* name, at::Tensor& x, const at::Tensor& packed, int64_t k_multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), name,
              ": x must be a 2-D bf16 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2,
              name, ": the weight must come from linear_bf16_pack");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), name, ": x and the packed weight disagree on K");
  TORCH_CHECK(x.size(1) % k_multiple == 0, name, ": K must be a multiple of ", k_multiple, ", got ", x.size(1));
  x = x.contiguous();
  return at::empty({x.size(0), packed.size(0) * 16}, x.options());
}

// out [M, N] = x [M, K] @ W^T, x and W in bf16 (W packed by linear_bf16_pack), fp32 accumulation.
at::Tensor linear_bf16(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(table().linear_bf16 != nullptr, "linear_bf16: the kernel variant '", table().name,
              "' has no AVX-512 BF16 (the CPU lacks it, or CONVEYOR_CPU_VARIANT chose another)");
  auto out = packed_linear_out("linear_bf16", x, packed, 2);
  if (out.size(0) > 0)
    table().linear_bf16(reinterpret_cast<const uint32_t*>(x.data_ptr()),
                        reinterpret_cast<const uint16_t*>(packed.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                        x.size(0), x.size(1), packed.size(0));
  return out;
}

bool linear_amx_available() { return table().linear_amx != nullptr; }

// out [M, N] = x [M, K] @ W^T on AMX tiles (W packed by linear_bf16_pack), fp32 accumulation, K % 32 == 0.
at::Tensor linear_amx(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(table().linear_amx != nullptr, "linear_amx: the kernel variant '", table().name,
              "' has no AMX (the CPU lacks it, Linux refused the tile state, or CONVEYOR_CPU_VARIANT chose another)");
  auto out = packed_linear_out("linear_amx", x, packed, 32);
  if (out.size(0) > 0)
    table().linear_amx(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                       reinterpret_cast<const uint16_t*>(packed.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                       x.size(0), x.size(1), packed.size(0));
  return out;
}

bool linear_avx2_available() { return table().linear_avx2 != nullptr; }

// out [M, N] = x [M, K] @ W^T with AVX2 FMAs (W packed by linear_bf16_pack, widened to fp32 in registers).
at::Tensor linear_avx2(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(table().linear_avx2 != nullptr, "linear_avx2: the kernel variant '", table().name,
              "' has no AVX2 + FMA (the CPU lacks them, or CONVEYOR_CPU_VARIANT chose another)");
  auto out = packed_linear_out("linear_avx2", x, packed, 2);
  if (out.size(0) > 0)
    table().linear_avx2(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                        reinterpret_cast<const uint16_t*>(packed.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                        x.size(0), x.size(1), packed.size(0));
  return out;
}

bool linear_int4_available() { return table().linear_int4 != nullptr; }

// out [M, N] = x [M, K] @ W^T, W as int4 groups of 32 (linear_int4.cpp): q uint8 [N/16, K/2, 16] and sz fp32
// [N/16, K/32, 2, 16] as conveyor/model/quantization.py packs them; x and out fp32 or bf16.
at::Tensor linear_int4(at::Tensor x, at::Tensor q, at::Tensor sz) {
  TORCH_CHECK(table().linear_int4 != nullptr, "linear_int4: the kernel variant '", table().name,
              "' has no AVX2 + FMA (the CPU lacks them, or CONVEYOR_CPU_VARIANT chose another)");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "linear_int4: x must be a 2-D CPU tensor");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(2) == 16 &&
                  sz.dim() == 4 && sz.scalar_type() == at::kFloat && sz.is_contiguous() && sz.size(0) == q.size(0) &&
                  sz.size(2) == 2 && sz.size(3) == 16,
              "linear_int4: the weight must come from quantization.py's int4 packing");
  const int64_t k = x.size(1), n = q.size(0) * 16;
  TORCH_CHECK(k % 32 == 0 && q.size(1) * 2 == k && sz.size(1) * 32 == k, "linear_int4: x and the weight disagree on K");
  const DType dt = float_dtype(x, "linear_int4");
  x = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0)
    table().linear_int4(dt, x.data_ptr(), q.data_ptr<uint8_t>(), sz.data_ptr<float>(), out.data_ptr(), x.size(0), k,
                        n);
  return out;
}

bool linear_int8_available() { return table().linear_int8 != nullptr; }

// out [M, N] = x [M, K] @ W^T, W as int8 with a scale per output channel (linear_int8.cpp): q int8 [N/16, K, 16]
// and scale fp32 [N] as conveyor/model/quantization.py packs them; x and out fp32 or bf16.
at::Tensor linear_int8(at::Tensor x, at::Tensor q, at::Tensor scale) {
  TORCH_CHECK(table().linear_int8 != nullptr, "linear_int8: the kernel variant '", table().name,
              "' has no AVX2 + FMA (the CPU lacks them, or CONVEYOR_CPU_VARIANT chose another)");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "linear_int8: x must be a 2-D CPU tensor");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(2) == 16 &&
                  scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == q.size(0) * 16,
              "linear_int8: the weight must come from quantization.py's int8 packing");
  const int64_t k = x.size(1), n = q.size(0) * 16;
  TORCH_CHECK(q.size(1) == k && k % 2 == 0, "linear_int8: x and the weight disagree on K, or K is odd");
  const DType dt = float_dtype(x, "linear_int8");
  x = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0)
    table().linear_int8(dt, x.data_ptr(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr(), x.size(0),
                        k, n);
  return out;
}

// --- GGUF block weights (linear_gguf.cpp) ---------------------------------------------------------------------
// ggml's type id -> (elements, bytes) of one block; (0, 0) for a type the kernels do not take
std::pair<int64_t, int64_t> gguf_block(int64_t type) {
  switch (type) {
    case 2: return {32, 18};    // Q4_0
    case 3: return {32, 20};    // Q4_1
    case 6: return {32, 22};    // Q5_0
    case 7: return {32, 24};    // Q5_1
    case 8: return {32, 34};    // Q8_0
    case 12: return {256, 144};  // Q4_K
    case 13: return {256, 176};  // Q5_K
    case 14: return {256, 210};  // Q6_K
    default: return {0, 0};
  }
}

// bytes of an n x k weight of `type`, checking what the packed layout needs (n % 16 == 0, k whole blocks)
int64_t gguf_bytes(int64_t type, int64_t n, int64_t k, const char* what) {
  const auto [qk, bb] = gguf_block(type);
  TORCH_CHECK(qk > 0, what, ": GGUF type ", type, " is not one the kernels take");
  TORCH_CHECK(n > 0 && n % 16 == 0 && k > 0 && k % qk == 0, what, ": a ", n, " x ", k,
              " weight does not fit (N a multiple of 16, K of ", qk, ")");
  return n * (k / qk) * bb;
}

bool gguf_available() { return table().gguf_linear != nullptr; }

// raw: uint8 [n, k / qk * block bytes] as the GGUF file holds the tensor -> the kernels' layout (as many bytes)
at::Tensor gguf_pack(int64_t type, at::Tensor raw, int64_t k) {
  TORCH_CHECK(table().gguf_pack != nullptr, "gguf_pack: not in this kernel variant");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.device().is_cpu(), "gguf_pack: raw uint8 [n, bytes]");
  const int64_t n = raw.size(0), bytes = gguf_bytes(type, n, k, "gguf_pack");
  TORCH_CHECK(raw.numel() == bytes, "gguf_pack: raw has ", raw.numel(), " bytes, a ", n, " x ", k, " weight ", bytes);
  raw = raw.contiguous();
  auto out = at::empty({bytes}, raw.options());
  table().gguf_pack(static_cast<int>(type), raw.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), n, k);
  return out;
}

void gguf_check_rows(const char* what, int64_t type, const at::Tensor& packed, int64_t n, int64_t k,
                     const at::Tensor& rows) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.numel() == gguf_bytes(type, n, k, what),
              what, ": packed must be gguf_pack's output for a ", n, " x ", k, " weight");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), what, ": rows int64 [count]");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(r[i] >= 0 && r[i] < n, what, ": row ", r[i], " out of range");
}

at::Tensor gguf_unpack_rows(int64_t type, at::Tensor packed, int64_t n, int64_t k, at::Tensor rows) {
  gguf_check_rows("gguf_unpack_rows", type, packed, n, k, rows);
  const auto [qk, bb] = gguf_block(type);
  auto out = at::empty({rows.numel(), k / qk * bb}, packed.options());
  if (rows.numel() > 0)
    table().gguf_unpack_rows(static_cast<int>(type), packed.data_ptr<uint8_t>(), n, k, rows.data_ptr<int64_t>(),
                             rows.numel(), out.data_ptr<uint8_t>());
  return out;
}

at::Tensor gguf_dequant_rows(int64_t type, at::Tensor packed, int64_t n, int64_t k, at::Tensor rows) {
  gguf_check_rows("gguf_dequant_rows", type, packed, n, k, rows);
  auto out = at::empty({rows.numel(), k}, packed.options().dtype(at::kFloat));
  if (rows.numel() > 0)
    table().gguf_dequant_rows(static_cast<int>(type), packed.data_ptr<uint8_t>(), n, k, rows.data_ptr<int64_t>(),
                              rows.numel(), out.data_ptr<float>());
  return out;
}

// x [m, k] fp32/bf16 -> (q int8 [m, k], d fp32 [m, k / qk], sums int32 [m, k / 16]): gguf_linear's activations
std::vector<at::Tensor> gguf_quantize_rows(at::Tensor x, int64_t qk) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (qk == 32 || qk == 256) && x.size(1) % qk == 0,
              "gguf_quantize_rows: x [m, k] with k a multiple of qk (32 or 256)");
  const DType dt = float_dtype(x, "gguf_quantize_rows");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  auto q = at::empty({m, k}, x.options().dtype(at::kChar));
  auto d = at::empty({m, k / qk}, x.options().dtype(at::kFloat));
  auto s = at::empty({m, k / 16}, x.options().dtype(at::kInt));
  if (m > 0)
    table().gguf_quantize_rows(dt, x.data_ptr(), m, k, qk, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>());
  return {q, d, s};
}

// Checks a GGUF linear's weights (packed: the parts' packed bytes one after the other; meta int64 [P, 3]: type,
// columns, byte offset into packed) against K, and returns the parts with their pointers.
std::vector<conveyor::GGUFPart> gguf_parts(const at::Tensor& packed, const at::Tensor& meta, int64_t k, int64_t* n_out) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.dim() == 1,
              "gguf_linear: packed uint8 [bytes]");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == 3 && meta.size(0) > 0 &&
                  meta.is_contiguous() && meta.device().is_cpu(),
              "gguf_linear: meta int64 [parts, 3] (type, columns, byte offset)");
  const int64_t* mp = meta.data_ptr<int64_t>();
  std::vector<conveyor::GGUFPart> parts;
  int64_t n = 0;
  for (int64_t p = 0; p < meta.size(0); ++p) {
    const int64_t type = mp[3 * p], cols = mp[3 * p + 1], off = mp[3 * p + 2];
    const int64_t bytes = gguf_bytes(type, cols, k, "gguf_linear");
    TORCH_CHECK(off >= 0 && off + bytes <= packed.numel(), "gguf_linear: part ", p, " lies outside packed");
    parts.push_back({static_cast<int>(type), cols, packed.data_ptr<uint8_t>() + off});
    n += cols;
  }
  *n_out = n;
  return parts;
}

// A GGUF linear's K, from its first part's bytes (gguf_parts then checks every part against it).
int64_t gguf_in_features(const at::Tensor& packed, const at::Tensor& meta) {
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == 3 && meta.size(0) > 0 &&
                  meta.is_contiguous(),
              "gguf_linear: meta int64 [parts, 3] (type, columns, byte offset)");
  const int64_t* mp = meta.data_ptr<int64_t>();
  const auto [qk, bb] = gguf_block(mp[0]);
  const int64_t end = meta.size(0) > 1 ? mp[5] : packed.numel(), bytes = end - mp[2];
  TORCH_CHECK(qk > 0 && mp[1] > 0 && bytes > 0 && bytes % (mp[1] * bb) == 0, "gguf_linear: part 0's bytes do not fit");
  return bytes / (mp[1] * bb) * qk;
}

// out [m, N] = x [m, K] @ W^T with W the GGUF parts (gguf_parts), each part's columns after the earlier parts'.
at::Tensor gguf_linear(at::Tensor x, at::Tensor packed, at::Tensor meta) {
  TORCH_CHECK(table().gguf_linear != nullptr, "gguf_linear: the kernel variant '", table().name,
              "' has no GGUF kernels (they need AVX2 + FMA + F16C, or AVX-512 VNNI)");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "gguf_linear: x must be a 2-D CPU tensor");
  const DType dt = float_dtype(x, "gguf_linear");
  int64_t n = 0;
  const auto parts = gguf_parts(packed, meta, x.size(1), &n);
  x = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0) {
    conveyor::GGUFLinearArgs a{x.data_ptr(), out.data_ptr(), parts.data(), static_cast<int64_t>(parts.size()),
                               x.size(0), x.size(1), n, dt};
    table().gguf_linear(a);
  }
  return out;
}
// --- end GGUF ---------------------------------------------------------------------------------------------------

// ---- W8A8 (linear_w8a8.cpp): int8 weights per channel x int8 activations per token, exact int32 sums ----

bool linear_w8a8_available() { return table().linear_w8a8 != nullptr; }

std::string w8a8_isa() { return table().w8a8_isa ? table().w8a8_isa : ""; }

// The packed W8A8 weight's checks (quantization's pack_w8a8): w int8 [N/16, Kp/4, 16, 4], comp int32 [N], sw fp32 [N].
void check_w8a8_weight(const at::Tensor& w, const at::Tensor& comp, const at::Tensor& sw, const char* what) {
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(2) == 16 && w.size(3) == 4 &&
                  comp.dim() == 1 && comp.scalar_type() == at::kInt && comp.is_contiguous() &&
                  comp.size(0) == w.size(0) * 16 && sw.dim() == 1 && sw.scalar_type() == at::kFloat &&
                  sw.is_contiguous() && sw.size(0) == w.size(0) * 16,
              what, ": the weight must come from quantization.py's W8A8 packing (pack_w8a8)");
}

// had: 0, or a power of two >= 16 dividing K: x's rows are Walsh-Hadamard transformed in blocks of `had` first.
void check_hadamard(int64_t had, int64_t k, const char* what) {
  TORCH_CHECK(had == 0 || (had >= 16 && (had & (had - 1)) == 0 && k % had == 0), what,
              ": the Hadamard block must be 0 or a power of two >= 16 that divides K (", k, "), got ", had);
}

// out [M, N] = W8A8 product of x [M, K] (fp32 or bf16, quantized per row inside) and the packed weight, in x's dtype.
at::Tensor linear_w8a8(at::Tensor x, at::Tensor w, at::Tensor comp, at::Tensor sw, int64_t had) {
  TORCH_CHECK(table().linear_w8a8 != nullptr, "linear_w8a8: the kernel variant '", table().name,
              "' has neither AVX-512 VNNI nor AVX2 (the CPU lacks them, or CONVEYOR_CPU_VARIANT chose another)");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "linear_w8a8: x must be a 2-D CPU tensor");
  check_w8a8_weight(w, comp, sw, "linear_w8a8");
  const int64_t k = x.size(1), n = w.size(0) * 16;
  TORCH_CHECK(w.size(1) == (k + 3) / 4, "linear_w8a8: x and the weight disagree on K");
  check_hadamard(had, k, "linear_w8a8");
  const DType dt = float_dtype(x, "linear_w8a8");
  x = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0)
    table().linear_w8a8(dt, x.data_ptr(), w.data_ptr<int8_t>(), comp.data_ptr<int32_t>(), sw.data_ptr<float>(),
                        out.data_ptr(), x.size(0), k, n, had);
  return out;
}

// x [M, K] (fp32 or bf16) -> (q int8 [M, K], scale fp32 [M]): the activations as linear_w8a8 quantizes them.
std::vector<at::Tensor> w8a8_quantize(at::Tensor x, int64_t had) {
  TORCH_CHECK(table().w8a8_quantize != nullptr, "w8a8_quantize: not in the kernel variant '", table().name, "'");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "w8a8_quantize: x must be a 2-D CPU tensor");
  check_hadamard(had, x.size(1), "w8a8_quantize");
  const DType dt = float_dtype(x, "w8a8_quantize");
  x = x.contiguous();
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scale = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.numel() > 0)
    table().w8a8_quantize(dt, x.data_ptr(), x.size(0), x.size(1), had, q.data_ptr<int8_t>(), scale.data_ptr<float>());
  return {q, scale};
}

// A Llama body's decoder layers in one call: the ops of LlamaModel's Python path (llama.py: DecoderLayer,
// Attention, MLP with the compiled kernels), the same kernels in the same order on the same values, so the
// bits are the same. Why: that path makes ~20 Python-level calls per layer (module calls, views, splits, one
// op each), about 4 ms of a 17 ms one-stream decode step of SmolLM2 on a 2-core Zen 3. Why raw pointers into
// one workspace rather than the ops above: those still cost ~20 ATen calls a layer (checks, at::empty, views),
// serial work on the engine thread while the other core spins; here a layer is the kernels' calls alone. (An
// estimate, ~0.6 ms a step; in process the A/B was within this VM's noise: docs/performance.md, 2026-12-04.)
// weights: per layer (input norm, qkv, o, post-attention norm, gate_up, down), the linears all packed for
// `linear` ("linear_bf16", "linear_amx" or "linear_avx2": one tensor each; "linear_int4" or "linear_int8":
// two, q and the scales; "gguf_linear": two, the packed bytes and the parts' meta; "linear_w8a8": three, w, comp and sw), no biases but Qwen2's q/k/v ones (`qkv_biases`: one per layer, or none). Returns (x, residual) as the last layer leaves them (the final norm is
// Python's); the residual is `residual_in`, or x, updated in place.
std::vector<at::Tensor> decoder_layers(at::Tensor x, c10::optional<at::Tensor> residual_in, at::Tensor cos,
                                       at::Tensor sin, const std::vector<at::Tensor>& weights,
                                       const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                                       at::Tensor slots, at::Tensor block_tables, at::Tensor cu_q, at::Tensor ctx_lens,
                                       int64_t heads, int64_t kv_heads, double eps, double scale,
                                       const std::string& linear, const std::vector<at::Tensor>& qkv_biases,
                                       const std::vector<int64_t>& w8a8_hadamard) {
  const Table& tb = table();
  const bool int4 = linear == "linear_int4", int8 = linear == "linear_int8", w8a8 = linear == "linear_w8a8";
  const bool bf16 = linear == "linear_bf16", amx = linear == "linear_amx", avx2 = linear == "linear_avx2";
  const bool gguf = linear == "gguf_linear";  // GGUF block weights (linear_gguf.cpp): packed bytes and meta
  const bool dense = bf16 || amx || avx2;
  TORCH_CHECK((bf16 && tb.linear_bf16) || (amx && tb.linear_amx) || (avx2 && tb.linear_avx2) ||
                  (int4 && tb.linear_int4) || (int8 && tb.linear_int8) || (gguf && tb.gguf_linear) ||
                  (w8a8 && tb.linear_w8a8),
              "decoder_layers: linear '", linear, "' is unknown or not in the variant '", tb.name, "'");
  const int64_t k_multiple = int4 || amx ? 32 : gguf || w8a8 ? 1 : 2;  // what each kernel needs of K (GGUF: its parts')
  // W8A8: each linear's Hadamard block (qkv, o, gate_up, down), the same in every layer
  TORCH_CHECK(!w8a8 || w8a8_hadamard.size() == 4, "decoder_layers: linear_w8a8 needs 4 Hadamard blocks (0: none)");
  // tensors per linear (s), per layer (per)
  const size_t layers = k_caches.size(), s = w8a8 ? 3 : int4 || int8 || gguf ? 2 : 1, per = 2 + 4 * s;
  std::vector<std::vector<conveyor::GGUFPart>> gguf_lin(gguf ? 4 * layers : 0);  // per layer and linear
  TORCH_CHECK(weights.size() == per * layers && v_caches.size() == layers && layers > 0 && x.dim() == 2 &&
                  x.is_contiguous(),
              "decoder_layers: ", per, " weights and one (K, V) cache per layer, x [T, hidden] contiguous");
  const int64_t t = x.size(0), hidden = x.size(1), d = k_caches[0].size(2);
  const int64_t qw = heads * d, kvw = kv_heads * d, qkv_w = qw + 2 * kvw;
  const DType dt = float_dtype(x, "decoder_layers");
  TORCH_CHECK(!dense || dt == DType::BF16, "decoder_layers: bf16 activations for ", linear);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() >= t * d / 2 && sin.numel() >= t * d / 2,
              "decoder_layers: cos/sin fp32 [T, D/2]");
  at::Tensor residual = residual_in.has_value() ? *residual_in : x;
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "decoder_layers: residual like x");
  // each linear's output width (qkv, o, gate_up, down) and input width; the weights' shapes must agree
  int64_t inter2 = 0;
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &weights[per * i];
    const at::Tensor* lw[4] = {w + 1, w + 1 + s, w + 2 + 2 * s, w + 2 + 3 * s};
    int64_t out_w[4], in_w[4];
    for (int j = 0; j < 4; ++j) {
      const at::Tensor& q = lw[j][0];
      TORCH_CHECK(q.is_contiguous(), "decoder_layers: layer ", i, "'s weights must be contiguous");
      if (int4) {
        TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 3 && lw[j][1].scalar_type() == at::kFloat &&
                        lw[j][1].is_contiguous() && lw[j][1].dim() == 4 && lw[j][1].size(1) * 32 == q.size(1) * 2,
                    "decoder_layers: int4 weights as quantization.py packs them");
        out_w[j] = q.size(0) * 16, in_w[j] = q.size(1) * 2;
      } else if (gguf) {
        in_w[j] = gguf_in_features(q, lw[j][1]);
        gguf_lin[4 * i + j] = gguf_parts(q, lw[j][1], in_w[j], &out_w[j]);
      } else if (w8a8) {
        check_w8a8_weight(q, lw[j][1], lw[j][2], "decoder_layers");
        out_w[j] = q.size(0) * 16, in_w[j] = -1;  // K padded to 4 in the packing: checked against the model below
      } else if (int8) {
        TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 3 && lw[j][1].scalar_type() == at::kFloat &&
                        lw[j][1].is_contiguous() && lw[j][1].numel() == q.size(0) * 16,
                    "decoder_layers: int8 weights as quantization.py packs them");
        out_w[j] = q.size(0) * 16, in_w[j] = q.size(1);
      } else {
        TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 4 && q.size(2) == 16 && q.size(3) == 2,
                    "decoder_layers: bf16 weights from linear_bf16_pack");
        out_w[j] = q.size(0) * 16, in_w[j] = q.size(1) * 2;
      }
      TORCH_CHECK(in_w[j] % k_multiple == 0, "decoder_layers: ", linear, " needs K a multiple of ", k_multiple);
    }
    if (i == 0) inter2 = out_w[2];
    if (w8a8) {  // the packing pads K to a multiple of 4: each linear's K is the model's, if its groups agree
      const int64_t model_in[4] = {hidden, qw, hidden, inter2 / 2};
      for (int j = 0; j < 4; ++j) {
        TORCH_CHECK(lw[j][0].size(1) == (model_in[j] + 3) / 4, "decoder_layers: layer ", i, "'s W8A8 weights disagree on K");
        in_w[j] = model_in[j];
        check_hadamard(w8a8_hadamard[j], in_w[j], "decoder_layers");
      }
    }
    TORCH_CHECK(out_w[0] == qkv_w && in_w[0] == hidden && out_w[1] == hidden && in_w[1] == qw &&
                    out_w[2] == inter2 && in_w[2] == hidden && out_w[3] == hidden && in_w[3] * 2 == inter2,
                "decoder_layers: layer ", i, "'s linears do not fit hidden ", hidden, ", heads ", heads, "x", d);
    TORCH_CHECK(w[0].is_contiguous() && w[0].numel() == hidden && w[0].scalar_type() == x.scalar_type() &&
                    w[1 + 2 * s].is_contiguous() && w[1 + 2 * s].numel() == hidden &&
                    w[1 + 2 * s].scalar_type() == x.scalar_type(),
                "decoder_layers: layer ", i, "'s norm weights");
    TORCH_CHECK(k_caches[i].scalar_type() == x.scalar_type() && v_caches[i].scalar_type() == x.scalar_type() &&
                    k_caches[i].is_contiguous() && v_caches[i].is_contiguous() && k_caches[i].dim() == 4 &&
                    k_caches[i].size(1) == kv_heads && k_caches[i].size(2) == d && v_caches[i].size(3) == d &&
                    v_caches[i].size(0) == k_caches[i].size(0),
                "decoder_layers: layer ", i, "'s K/V cache [blocks, Hkv, D, block] / [blocks, Hkv, block, D] in x's dtype");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == t,
              "decoder_layers: slots int64 [T]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  cu_q.scalar_type() == at::kInt && cu_q.is_contiguous() && ctx_lens.scalar_type() == at::kInt &&
                  ctx_lens.is_contiguous() && cu_q.numel() == ctx_lens.numel() + 1,
              "decoder_layers: int32 block tables, cu_q, ctx_lens");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= MAX_ROWS &&
                  std::find(std::begin(HEAD_DIMS), std::end(HEAD_DIMS), d) != std::end(HEAD_DIMS),
              "decoder_layers: GQA group or head_dim ", d, " not compiled in");
  // Qwen2's q/k/v biases (one per layer, or none): added by torch's own add_, as PackedLinear.forward adds
  // them, so the bits stay the loop's
  TORCH_CHECK(qkv_biases.empty() || qkv_biases.size() == layers, "decoder_layers: one qkv bias per layer, or none");
  for (const at::Tensor& b : qkv_biases)
    TORCH_CHECK(b.dim() == 1 && b.numel() == qkv_w && b.scalar_type() == x.scalar_type() && b.device().is_cpu(),
                "decoder_layers: a qkv bias [", qkv_w, "] in x's dtype");
  at::Tensor out = at::empty_like(x);
  if (t == 0) return {out, residual};
  // one workspace: the norm's output, qkv, q, attention's output, gate_up, its activation
  const int64_t inter = inter2 / 2, es = x.element_size();
  const int64_t sizes[6] = {t * hidden, t * qkv_w, t * qw, t * qw, t * inter2, t * inter};
  int64_t total = 0;
  for (int64_t n : sizes) total += (n + 31) / 32 * 32;  // 64-byte aligned pieces
  at::Tensor ws = at::empty({total}, x.options());
  char* p = static_cast<char*>(ws.data_ptr());
  void* buf[6];
  for (int j = 0; j < 6; ++j) buf[j] = p, p += (sizes[j] + 31) / 32 * 32 * es;
  void *xn = buf[0], *qkv = buf[1], *qb = buf[2], *ob = buf[3], *gu = buf[4], *act = buf[5];
  // qkv's piece as a tensor, for the biases' add_
  const at::Tensor qkv_t = ws.narrow(0, (static_cast<char*>(qkv) - static_cast<char*>(ws.data_ptr())) / es, t * qkv_w)
                               .view({t, qkv_w});
  size_t layer = 0;  // the layer `apply` runs (for the GGUF parts)
  // `which`: the layer's linear (0 qkv, 1 o, 2 gate_up, 3 down)
  auto apply = [&](const void* in, const at::Tensor* w, void* o, int64_t k, int64_t n, int which) {
    if (gguf) {
      const auto& parts = gguf_lin[4 * layer + which];
      const conveyor::GGUFLinearArgs a{in, o, parts.data(), static_cast<int64_t>(parts.size()), t, k, n, dt};
      tb.gguf_linear(a);
    } else if (int4)
      tb.linear_int4(dt, in, w[0].data_ptr<uint8_t>(), w[1].data_ptr<float>(), o, t, k, n);
    else if (int8)
      tb.linear_int8(dt, in, w[0].data_ptr<int8_t>(), w[1].data_ptr<float>(), o, t, k, n);
    else if (w8a8)
      tb.linear_w8a8(dt, in, w[0].data_ptr<int8_t>(), w[1].data_ptr<int32_t>(), w[2].data_ptr<float>(), o, t, k, n,
                     w8a8_hadamard[which]);
    else if (bf16)
      tb.linear_bf16(static_cast<const uint32_t*>(in), static_cast<const uint16_t*>(w[0].data_ptr()),
                     static_cast<uint16_t*>(o), t, k, n / 16);
    else
      (amx ? tb.linear_amx : tb.linear_avx2)(static_cast<const uint16_t*>(in),
                                             static_cast<const uint16_t*>(w[0].data_ptr()),
                                             static_cast<uint16_t*>(o), t, k, n / 16);
  };
  char* xp = static_cast<char*>(out.data_ptr());
  char* rp = static_cast<char*>(residual.data_ptr());
  const bool first_is_embedding = !residual_in.has_value();
  conveyor::WriteKVArgs kv{};
  kv.slots = slots.data_ptr<int64_t>();
  kv.n = t, kv.kv_heads = kv_heads, kv.head_dim = d, kv.k_stride0 = qkv_w, kv.k_stride1 = d, kv.v_stride0 = qkv_w,
  kv.v_stride1 = d, kv.dtype = dt, kv.cache_dtype = dt;
  conveyor::AttentionArgs attn{};
  attn.q = qb, attn.out = ob, attn.block_tables = block_tables.data_ptr<int32_t>(), attn.cu_q = cu_q.data_ptr<int32_t>();
  attn.ctx_lens = ctx_lens.data_ptr<int32_t>(), attn.num_seqs = ctx_lens.size(0), attn.heads = heads;
  attn.kv_heads = kv_heads, attn.head_dim = d, attn.table_stride = block_tables.size(1), attn.q_stride_t = qw;
  attn.scale = static_cast<float>(scale), attn.dtype = dt, attn.cache_dtype = dt;
  for (size_t i = 0; i < layers; ++i) {
    // input norm, qkv, o, post-attention norm, gate_up, down
    const at::Tensor* w = &weights[per * i];
    layer = i;
    // the first layer: the embeddings are the residual stream, normed alone; then residual += x, norm
    if (i == 0 && first_is_embedding)
      tb.rms_norm(dt, rp, nullptr, w[0].data_ptr(), t, hidden, static_cast<float>(eps), xn);
    else
      tb.rms_norm(dt, i == 0 ? x.data_ptr() : xp, rp, w[0].data_ptr(), t, hidden, static_cast<float>(eps), xn);
    apply(xn, w + 1, qkv, hidden, qkv_w, 0);
    if (!qkv_biases.empty()) qkv_t.add_(qkv_biases[i]);
    char* qkvp = static_cast<char*>(qkv);
    tb.rope(dt, qkvp, t, heads, d, qkv_w, cos.data_ptr<float>(), sin.data_ptr<float>());
    tb.rope(dt, qkvp + qw * es, t, kv_heads, d, qkv_w, cos.data_ptr<float>(), sin.data_ptr<float>());
    const at::Tensor &kc = k_caches[i], &vc = v_caches[i];
    kv.k = qkvp + qw * es, kv.v = qkvp + (qw + kvw) * es, kv.k_cache = kc.data_ptr(), kv.v_cache = vc.data_ptr();
    kv.block_size = kc.size(3), kv.block_stride = kc.stride(0);
    tb.write_kv_cache(kv);
    for (int64_t r = 0; r < t; ++r)  // q, contiguous for the attention kernel
      std::memcpy(static_cast<char*>(qb) + r * qw * es, qkvp + r * qkv_w * es, qw * es);
    attn.k_cache = kc.data_ptr(), attn.v_cache = vc.data_ptr(), attn.block_size = kc.size(3), attn.block_stride = kc.stride(0);
    tb.paged_attention(attn);
    apply(ob, w + 1 + s, xp, qw, hidden, 1);
    tb.rms_norm(dt, xp, rp, w[1 + 2 * s].data_ptr(), t, hidden, static_cast<float>(eps), xn);
    apply(xn, w + 2 + 2 * s, gu, hidden, inter2, 2);
    tb.silu_and_mul(dt, gu, act, t, inter);
    apply(act, w + 2 + 3 * s, xp, inter, hidden, 3);
  }
  return {out, residual};
}

// logits [B, V] float32 (not modified); temperature/top_p/min_p [B] float32, top_k [B] int64 (<= 0 or >= V:
// off), uniform [B] float64 in [0, 1). Returns the sampled token of each row, int64 [B] (sampler.cpp).
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                       at::Tensor min_p, at::Tensor uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "sample_rows: logits must be a contiguous [B, V] float32 CPU tensor");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "sample_rows: bad vocabulary size");
  auto check = [B](const at::Tensor& t, at::ScalarType dt, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.scalar_type() == dt && t.is_contiguous() && t.device().is_cpu(),
                "sample_rows: ", name, " must be a contiguous [B] CPU tensor of ", dt);
  };
  check(temperature, at::kFloat, "temperature");
  check(top_k, at::kLong, "top_k");
  check(top_p, at::kFloat, "top_p");
  check(min_p, at::kFloat, "min_p");
  check(uniform, at::kDouble, "uniform");
  const float* temp = temperature.data_ptr<float>();
  const float* tp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const double* u = uniform.data_ptr<double>();
  for (int64_t r = 0; r < B; ++r)
    TORCH_CHECK(temp[r] > 0.0f && tp[r] > 0.0f && tp[r] <= 1.0f && mp[r] >= 0.0f && mp[r] <= 1.0f && u[r] >= 0.0 &&
                    u[r] < 1.0,
                "sample_rows: row ", r, " has an out-of-range parameter");
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  table().sample_rows(logits.data_ptr<float>(), B, V, temp, top_k.data_ptr<int64_t>(), tp, mp, u,
                      out.data_ptr<int64_t>());
  return out;
}

// logits [B, V] float32 (not modified): (values [B] float32, indices [B] int64) as torch.max(logits, dim=-1)
// gives them (sampler.cpp).
std::vector<at::Tensor> argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0,
              "argmax_rows: logits must be a contiguous [B, V > 0] float32 CPU tensor");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto top = at::empty({B}, logits.options());
  auto idx = at::empty({B}, logits.options().dtype(at::kLong));
  table().argmax_rows(logits.data_ptr<float>(), B, V, top.data_ptr<float>(), idx.data_ptr<int64_t>());
  return {top, idx};
}

// LoRA: y [n, out] += (x @ a[s]^T) @ bt[s] over each segment s's rows (lora_sgmv.cpp); segments: int64
// [S, 2] (start row, end row); a[s] [R_s, in], bt[s] [R_s, out] in y's dtype, blocks[s] int64 [P_s, 4]
// (first rank row, rank rows, first output column, output columns) of bt[s]'s non-zero blocks; an empty
// a[s] skips segment s.
void lora_sgmv_(at::Tensor y, at::Tensor x, at::Tensor segments, std::vector<at::Tensor> a_,
                std::vector<at::Tensor> bt_, std::vector<at::Tensor> blocks_) {
  constexpr int64_t kRows = 4;  // rows per block of work (lora_sgmv.cpp's register block)
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora_sgmv_: y [n, out] and x [n, in]");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous(), "lora_sgmv_: y and x must be contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_sgmv_: y and x must share a dtype");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16,
              "lora_sgmv_: float32 or bfloat16 only");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 2,
              "lora_sgmv_: segments int64 [S, 2]");
  const int64_t S = segments.size(0), in = x.size(1), out = y.size(1), n = y.size(0);
  TORCH_CHECK(static_cast<int64_t>(a_.size()) == S && static_cast<int64_t>(bt_.size()) == S &&
                  static_cast<int64_t>(blocks_.size()) == S,
              "lora_sgmv_: one a, one bt and one blocks per segment");
  auto seg = segments.contiguous();
  const int64_t* sp = seg.data_ptr<int64_t>();
  std::vector<int64_t> work, rank(S, 0), num_blocks(S, 0);
  std::vector<const void*> a(S, nullptr), b(S, nullptr);
  std::vector<const int64_t*> blocks(S, nullptr);
  for (int64_t s = 0; s < S; ++s) {
    if (a_[s].numel() == 0) continue;
    const int64_t R = a_[s].size(0);
    TORCH_CHECK(a_[s].dim() == 2 && bt_[s].dim() == 2 && a_[s].size(1) == in && bt_[s].size(1) == out &&
                    bt_[s].size(0) == R && a_[s].is_contiguous() && bt_[s].is_contiguous() &&
                    a_[s].scalar_type() == y.scalar_type() && bt_[s].scalar_type() == y.scalar_type(),
                "lora_sgmv_: segment ", s, " needs contiguous a [R, in] and bt [R, out] in y's dtype");
    const at::Tensor& bl = blocks_[s];
    TORCH_CHECK(bl.scalar_type() == at::kLong && bl.dim() == 2 && bl.size(1) == 4 && bl.is_contiguous(),
                "lora_sgmv_: blocks of segment ", s, " must be contiguous int64 [P, 4]");
    const int64_t* bp = bl.data_ptr<int64_t>();
    for (int64_t i = 0; i < bl.size(0); ++i, bp += 4)
      TORCH_CHECK(bp[0] >= 0 && bp[1] >= 0 && bp[0] + bp[1] <= R && bp[2] >= 0 && bp[3] >= 0 && bp[2] + bp[3] <= out,
                  "lora_sgmv_: block ", i, " of segment ", s, " is outside bt");
    TORCH_CHECK(0 <= sp[2 * s] && sp[2 * s] <= sp[2 * s + 1] && sp[2 * s + 1] <= n, "lora_sgmv_: bad segment ", s);
    rank[s] = R;
    a[s] = a_[s].data_ptr();
    b[s] = bt_[s].data_ptr();
    blocks[s] = bl.data_ptr<int64_t>();
    num_blocks[s] = bl.size(0);
    for (int64_t r = sp[2 * s]; r < sp[2 * s + 1]; r += kRows) {
      work.push_back(r);
      work.push_back(std::min<int64_t>(kRows, sp[2 * s + 1] - r));
      work.push_back(s);
    }
  }
  if (work.empty()) return;
  conveyor::LoRAArgs p{y.data_ptr(), x.data_ptr(), in, out, work.data(), static_cast<int64_t>(work.size()) / 3,
             a.data(), b.data(), rank.data(), blocks.data(), num_blocks.data(),
             y.scalar_type() == at::kFloat ? conveyor::DType::F32 : conveyor::DType::BF16};
  table().lora_sgmv(p);
}

}  // namespace

namespace py = pybind11;

// Every op releases the GIL while it runs: the server's event loop keeps streaming meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
#ifdef CONVEYOR_SOURCE_HASH
  m.def("source_hash", &source_hash, "the hash of the csrc/ files this module was built from (setup.py)");
#endif
  m.def("parallel_threads_used", &parallel_threads_used, "threads of the pool a kernel loop over n items ran on");
  m.def("variant", &variant, "the instruction-set variant the ops run (empty: none loaded yet)");
  m.def("load_variant", &load_variant, "load a variant's library (its path) and run its ops; returns its name");
  m.def("paged_attention", &paged_attention, "paged attention over the block pool (CPU)", py::arg("out"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("cu_q"),
        py::arg("ctx_lens"), py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        release());
  m.def("write_kv_cache", &write_kv_cache, "scatter K/V into their cache slots (CPU)", py::arg("k"), py::arg("v"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), release());
  m.def("rms_norm", &rms_norm, "[residual +=] x; RMSNorm (CPU)", release());
  m.def("rope_", &rope_, "rotary embedding in place (CPU)", release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)", release());
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "ban the logits a grammar's bitmask excludes (CPU)",
        release());
  m.def("linear_bf16_available", &linear_bf16_available, "whether the chosen variant has the AVX-512 BF16 linear");
  m.def("linear_bf16_pack", &linear_bf16_pack, "a bf16 weight [N, K] in linear_bf16's layout", release());
  m.def("linear_bf16", &linear_bf16, "x @ W^T in bf16 with vdpbf16ps, batch-invariant (CPU)", release());
  m.def("linear_avx2_available", &linear_avx2_available, "whether the chosen variant has the AVX2 bf16 linear");
  m.def("linear_avx2", &linear_avx2, "x @ W^T, bf16 weights widened to fp32, AVX2 FMAs, batch-invariant (CPU)",
        release());
  m.def("linear_amx_available", &linear_amx_available, "whether the chosen variant and this CPU run AMX tiles");
  m.def("linear_amx", &linear_amx, "x @ W^T in bf16 on AMX tiles, batch-invariant (CPU)", release());
  m.def("linear_int4_available", &linear_int4_available, "whether the chosen variant has the AVX2 int4 linear");
  m.def("linear_int4", &linear_int4, "x @ W^T with W as int4 groups of 32, AVX2 FMAs, batch-invariant (CPU)",
        release());
  m.def("linear_int8_available", &linear_int8_available, "whether the chosen variant has the AVX2 int8 linear");
  m.def("linear_int8", &linear_int8, "x @ W^T with W as int8 per channel, AVX2 FMAs, batch-invariant (CPU)",
        release());
  // GGUF block weights (linear_gguf.cpp)
  m.def("gguf_available", &gguf_available, "whether the chosen variant has the GGUF block-weight linear");
  m.def("gguf_pack", &gguf_pack, "a GGUF tensor's blocks [n, bytes] in gguf_linear's layout", py::arg("type"),
        py::arg("raw"), py::arg("k"), release());
  m.def("gguf_unpack_rows", &gguf_unpack_rows, "rows of a packed GGUF weight back as GGUF blocks", py::arg("type"),
        py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("rows"), release());
  m.def("gguf_dequant_rows", &gguf_dequant_rows, "rows of a packed GGUF weight dequantized as gguf-py does (fp32)",
        py::arg("type"), py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("rows"), release());
  m.def("gguf_quantize_rows", &gguf_quantize_rows, "activations as gguf_linear quantizes them: (q, d, sums per 16)",
        py::arg("x"), py::arg("qk"), release());
  m.def("gguf_linear", &gguf_linear, "x @ W^T with W GGUF blocks (several parts), int8 dot products (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("meta"), release());
  m.def("linear_w8a8_available", &linear_w8a8_available, "whether the chosen variant has the W8A8 int8 linear");
  m.def("w8a8_isa", &w8a8_isa, "the instructions the W8A8 linear runs on here: avx512-vnni, avx2 (empty: none)");
  m.def("linear_w8a8", &linear_w8a8, "x @ W^T in W8A8: int8 weights per channel, int8 activations per token, exact "
        "int32 sums, batch-invariant (CPU)", py::arg("x"), py::arg("w"), py::arg("comp"), py::arg("sw"),
        py::arg("hadamard") = 0, release());
  m.def("w8a8_quantize", &w8a8_quantize, "x's rows as linear_w8a8 quantizes them: (int8 q, fp32 scale)", py::arg("x"),
        py::arg("hadamard") = 0, release());
  m.def("decoder_layers", &decoder_layers, "a Llama body's decoder layers in one call, as llama.py runs them (CPU)",
        py::arg("x"), py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("weights"), py::arg("k_caches"),
        py::arg("v_caches"), py::arg("slots"), py::arg("block_tables"), py::arg("cu_q"), py::arg("ctx_lens"),
        py::arg("heads"), py::arg("kv_heads"), py::arg("eps"), py::arg("scale"), py::arg("linear"),
        py::arg("qkv_biases") = std::vector<at::Tensor>(), py::arg("w8a8_hadamard") = std::vector<int64_t>(),
        release());
  m.def("argmax_rows", &argmax_rows, "each row's largest value and its first index, as torch.max(dim=-1) (CPU)",
        release());
  m.def("lora_sgmv_", &lora_sgmv_, "y += LoRA deltas of every adapter segment of a step (CPU)", release());
  m.def("sample_rows", &sample_rows, "temperature, top-k, top-p, min-p and one draw per row, no sort (CPU)",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::arg("uniform"), release());
}
