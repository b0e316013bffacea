// LoRA's low-rank products for a whole step in one call per linear: S-LoRA / Punica's SGMV on the CPU.
//
// y[rows of segment s] += (x[rows] @ At_s) @ Bt_s for every segment s of the step (one adapter's rows),
// with At_s [in, R] and Bt_s [R, out] (the adapter's A and scaled B, transposed). Why compiled: in torch
// each segment costs two small matmuls, ~20 us each in bf16 whatever their size, and a step with 16
// adapters has 16 segments in each of a model's 120 linears: ~80 ms of dispatch for a few ms of math.
// Here one call does every segment; each row is one thread's work, start to end, in fp32:
//   shrink  t[r] += x[k] * At[k][r]      (k outer, r inner: contiguous, vectorized without reordering sums)
//   expand  acc[o] += t[r] * Bt[r][o]     (r outer, o inner: the same)
// and y = y + acc rounded once. A row's result depends only on its own inputs and its adapter, never on
// the rows beside it: batch-invariant by construction.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t u = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
void sgmv(T* y, const T* x, int64_t in, int64_t out, const std::vector<int64_t>& row_seg,
          const std::vector<const T*>& at, const std::vector<const T*>& bt, const std::vector<int64_t>& rank) {
  const int64_t n = static_cast<int64_t>(row_seg.size()) / 2;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t, acc(out);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = row_seg[2 * i], s = row_seg[2 * i + 1];
      const int64_t r_n = rank[s];
      const T* a = at[s];
      const T* b = bt[s];
      t.assign(r_n, 0.f);
      const T* xr = x + row * in;
      for (int64_t k = 0; k < in; ++k) {
        const float xv = load(xr, k);
        const T* ak = a + k * r_n;
        for (int64_t r = 0; r < r_n; ++r) t[r] += xv * load(ak, r);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t r = 0; r < r_n; ++r) {
        const float tv = t[r];
        const T* br = b + r * out;
        for (int64_t o = 0; o < out; ++o) acc[o] += tv * load(br, o);
      }
      T* yr = y + row * out;
      for (int64_t o = 0; o < out; ++o) yr[o] = static_cast<T>(load(yr, o) + acc[o]);
    }
  });
}

}  // namespace

// y [n, out] += per segment; segments: int64 [S, 2] (start row, end row); at[s] [in, R_s], bt[s] [R_s, out]
// in y's dtype (float32 or bfloat16); an empty at[s] skips segment s (its adapter leaves this linear alone).
void lora_sgmv_(torch::Tensor y, torch::Tensor x, torch::Tensor segments, std::vector<torch::Tensor> at,
                std::vector<torch::Tensor> bt) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora_sgmv_: y [n, out] and x [n, in]");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous(), "lora_sgmv_: y and x must be contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_sgmv_: y and x must share a dtype");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 2,
              "lora_sgmv_: segments int64 [S, 2]");
  const int64_t S = segments.size(0), in = x.size(1), out = y.size(1), n = y.size(0);
  TORCH_CHECK(static_cast<int64_t>(at.size()) == S && static_cast<int64_t>(bt.size()) == S,
              "lora_sgmv_: one at and one bt per segment");
  auto seg = segments.contiguous();
  const int64_t* sp = seg.data_ptr<int64_t>();
  std::vector<int64_t> row_seg, rank(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    if (at[s].numel() == 0) continue;
    TORCH_CHECK(at[s].dim() == 2 && bt[s].dim() == 2 && at[s].size(0) == in && bt[s].size(1) == out &&
                    at[s].size(1) == bt[s].size(0) && at[s].is_contiguous() && bt[s].is_contiguous() &&
                    at[s].scalar_type() == y.scalar_type() && bt[s].scalar_type() == y.scalar_type(),
                "lora_sgmv_: segment ", s, " needs contiguous at [in, R] and bt [R, out] in y's dtype");
    TORCH_CHECK(0 <= sp[2 * s] && sp[2 * s] <= sp[2 * s + 1] && sp[2 * s + 1] <= n, "lora_sgmv_: bad segment ", s);
    rank[s] = at[s].size(1);
    for (int64_t r = sp[2 * s]; r < sp[2 * s + 1]; ++r) {
      row_seg.push_back(r);
      row_seg.push_back(s);
    }
  }
  if (row_seg.empty()) return;
  if (y.scalar_type() == at::kFloat) {
    std::vector<const float*> a(S), b(S);
    for (int64_t s = 0; s < S; ++s)
      if (rank[s]) a[s] = at[s].data_ptr<float>(), b[s] = bt[s].data_ptr<float>();
    sgmv<float>(y.data_ptr<float>(), x.data_ptr<float>(), in, out, row_seg, a, b, rank);
  } else if (y.scalar_type() == at::kBFloat16) {
    std::vector<const at::BFloat16*> a(S), b(S);
    for (int64_t s = 0; s < S; ++s)
      if (rank[s]) a[s] = at[s].data_ptr<at::BFloat16>(), b[s] = bt[s].data_ptr<at::BFloat16>();
    sgmv<at::BFloat16>(y.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), in, out, row_seg, a, b, rank);
  } else {
    TORCH_CHECK(false, "lora_sgmv_: float32 or bfloat16 only");
  }
}
