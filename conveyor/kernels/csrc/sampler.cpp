// Sampling without sorting the vocabulary: temperature, top-k, top-p and min-p, then one draw.
//
// The torch reference (conveyor/runner/sampler.py, `sample_reference`) sorts every row's 49,152 logits
// for top-p, then takes a softmax, a cumulative sum and a scatter of the whole row: 189 ms for 64 rows
// at temperature 0.2 / top_p 0.9 on 2 cores, twice a whole decode step of the model. What the cut-offs
// need is only a *threshold*: every rule keeps exactly the tokens whose probability is at least some
// value t (ties at t kept), so a row is
//   1. e_i = exp((x_i - max) / T)              one vectorised pass; e in [0, 1], the best token has 1
//   2. t = max(t_top_k, t_top_p, min_p)        a radix select on e's float bits, not a sort
//   3. the token where the cumulative kept mass, in token-id order, first exceeds u * (kept mass)
// with one uniform u per row (inverse-CDF sampling: one random number instead of 49,152 exponentials).
//
// Selection: positive floats order like their bit patterns, so "the first token, in descending order,
// whose inclusive cumulative weight exceeds a target" (weight 1 and target k-1 for top-k; weight e and
// target p * Z_k for top-p) is found by three histogram passes over 11, 10 and 10 bits of those
// patterns, each over the previous level's boundary bucket only. For top-p the first pass only needs
// the tokens with e >= (1-p) Z_k / (2V): all lighter tokens together hold less than (1-p) Z_k / 2 of the
// mass, so the cut falls above them, and at a low temperature that leaves a few dozen candidates.
//
// The rules and their order are the reference's (vLLM's): top-k on the tempered logits, top-p on what
// top-k kept (renormalised), min-p relative to the best token; so the kept set is the reference's,
// up to float rounding at the boundary (tests/runner/test_sampler_kernel.py compares both, and a
// chi-square test checks the draws against the reference's probabilities).

#include "kernel_api.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace conveyor {
namespace CONVEYOR_VARIANT {

namespace {

using conveyor::exp_approx;

// positive floats order like their bit patterns (dtypes.h's float_to_bits / bits_to_float)
float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// e[i] = exp((x[i] - m) * inv_t); returns their sum.
double exp_row(const float* x, int64_t n, float m, float inv_t, float* e) {
  int64_t i = 0;
  double total = 0.0;
#ifdef __AVX512F__
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t);
  __m512 acc = _mm512_setzero_ps();
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; i + 16 <= n; i += 16) {
    const __m512 xi = _mm512_loadu_ps(x + i);
    // a banned token (-inf: grammar, bias, min_tokens) gets exactly 0, not exp's clamped exp(-87)
    const __m512 v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(xi, ninf, _CMP_NEQ_OQ),
                                         conveyor::exp16(_mm512_mul_ps(_mm512_sub_ps(xi, vm), vt)));
    _mm512_storeu_ps(e + i, v);
    acc = _mm512_add_ps(acc, v);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  float tail = 0.0f;
  for (; i < n; ++i) {
    e[i] = x[i] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_approx((x[i] - m) * inv_t);
    tail += e[i];
  }
  return total + tail;
}

// Sum of the e[i] >= t.
double kept_mass(const float* e, int64_t n, float t) {
  int64_t i = 0;
  double total = 0.0;
#ifdef __AVX512F__
  const __m512 vt = _mm512_set1_ps(t);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ), acc, v);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i)
    if (e[i] >= t) total += e[i];
  return total;
}

// Indices of the e[i] >= t, in order.
void gather_at_least(const float* e, int64_t n, float t, std::vector<int32_t>& out) {
  out.resize(n);
  int32_t* o = out.data();
  int64_t k = 0, i = 0;
#ifdef __AVX512F__
  const __m512 vt = _mm512_set1_ps(t);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(e + i), vt, _CMP_GE_OQ);
    if (keep) {
      _mm512_mask_compressstoreu_epi32(o + k, keep, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)i)));
      k += __builtin_popcount(keep);
    }
  }
#endif
  for (; i < n; ++i)
    if (e[i] >= t) o[k++] = (int32_t)i;
  out.resize(k);
}

// The value of the first element, in descending order of e over `cand` (all n elements when `cand` is
// null), whose inclusive cumulative weight exceeds `target` (weight: e itself when `by_mass`, else 1).
// Returns 0 (keep everything) when no element's does.
float select_desc(const float* e, int64_t n, const std::vector<int32_t>* cand, double target, bool by_mass,
                  std::vector<int32_t>& scratch_a, std::vector<int32_t>& scratch_b) {
  constexpr int kLevels = 3;
  constexpr int kShift[kLevels] = {20, 10, 0};
  constexpr uint32_t kMask[kLevels] = {0x7ff, 0x3ff, 0x3ff};
  static thread_local double weight[2048];
  const std::vector<int32_t>* cur = cand;
  uint32_t prefix = 0;
  for (int level = 0; level < kLevels; ++level) {
    const int shift = kShift[level];
    const uint32_t mask = kMask[level];
    const int nb = (int)mask + 1;
    std::fill(weight, weight + nb, 0.0);
    const int64_t m = cur ? (int64_t)cur->size() : n;
    const int32_t* idx = cur ? cur->data() : nullptr;
    for (int64_t j = 0; j < m; ++j) {
      const float v = e[idx ? idx[j] : j];
      weight[(float_to_bits(v) >> shift) & mask] += by_mass ? (double)v : 1.0;
    }
    double acc = 0.0;
    int b = nb - 1, lowest = -1;
    for (; b >= 0; --b) {
      if (weight[b] == 0.0) continue;
      lowest = b;
      if (acc + weight[b] > target) break;
      acc += weight[b];
    }
    if (b < 0) {  // nothing crossed: float rounding at this level's edge, or the target is the whole mass
      if (level == 0 || lowest < 0) return 0.0f;
      b = lowest;  // keep this level's elements down to its smallest
    }
    target -= acc;
    prefix |= (uint32_t)b << shift;
    if (level == kLevels - 1) break;
    std::vector<int32_t>& next = (cur == &scratch_a) ? scratch_b : scratch_a;
    next.clear();
    for (int64_t j = 0; j < m; ++j) {
      const int32_t i = idx ? idx[j] : (int32_t)j;
      if (((float_to_bits(e[i]) >> shift) & mask) == (uint32_t)b) next.push_back(i);
    }
    cur = &next;
  }
  return bits_to_float(prefix);
}

// The token where the cumulative kept mass (e >= t), in token-id order, first exceeds u * total.
int64_t draw(const float* e, int64_t n, float t, double u, std::vector<double>& block_sums) {
  constexpr int64_t kBlock = 256;
  const int64_t nb = (n + kBlock - 1) / kBlock;
  block_sums.resize(nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kBlock;
    block_sums[b] = kept_mass(e + lo, std::min(kBlock, n - lo), t);
    total += block_sums[b];
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t b = 0; b < nb; ++b) {
    if (block_sums[b] == 0.0) continue;
    const int64_t lo = b * kBlock, hi = std::min(lo + kBlock, n);
    if (acc + block_sums[b] > target) {
      for (int64_t i = lo; i < hi; ++i) {
        if (e[i] < t) continue;
        acc += e[i];
        last = i;
        if (acc > target) return i;
      }
      return last;  // rounding: the scan's sum fell short of the block's; its last kept token
    }
    acc += block_sums[b];
    for (int64_t i = hi - 1; i >= lo; --i)
      if (e[i] >= t) { last = i; break; }
  }
  return last;  // u * total rounded up to total: the last kept token
}

struct Scratch {
  std::vector<float> e;
  std::vector<int32_t> cand, a, b;
  std::vector<double> blocks;
};

int64_t sample_row(const float* x, int64_t V, float temp, int64_t top_k, float top_p, float min_p, double u,
                   Scratch& s) {
  const float m = row_max(x, V);
  if (!std::isfinite(m)) return 0;  // a broken row: the caller reports it and drops the token
  s.e.resize(V);
  float* e = s.e.data();
  const double Z = exp_row(x, V, m, 1.0f / temp, e);
  float t = 0.0f;
  double Zk = Z;
  if (top_k > 0 && top_k < V) {
    t = select_desc(e, V, nullptr, (double)(top_k - 1), false, s.a, s.b);
    Zk = kept_mass(e, V, t);
  }
  if (top_p < 1.0f) {
    // tokens lighter than this hold under (1 - p) Z_k / 2 of the mass together: the cut is above them
    const float floor = (float)(0.5 * (1.0 - (double)top_p) * Zk / (double)V);
    gather_at_least(e, V, std::max(floor, t), s.cand);
    t = std::max(t, select_desc(e, V, &s.cand, (double)top_p * Zk, true, s.a, s.b));
  }
  if (min_p > 0.0f) t = std::max(t, min_p);  // relative to the best token, whose e is 1
  // never a token of probability 0 (banned), nor one whose e underflowed (under 1e-38 of the best's)
  t = std::max(t, std::numeric_limits<float>::min());
  return draw(e, V, t, u, s.blocks);
}

}  // namespace

// logits [B, V] float32 row-major (not modified); temperature, top_p, min_p [B]; top_k [B] (<= 0 or >= V: off);
// uniform [B] in [0, 1). Writes the sampled token of each row to out [B]. The caller checks the ranges.
void sample_rows(const float* logits, int64_t B, int64_t V, const float* temp, const int64_t* top_k,
                 const float* top_p, const float* min_p, const double* u, int64_t* out) {
  parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t r = begin; r < end; ++r)
      out[r] = sample_row(logits + r * V, V, temp[r], top_k[r], top_p[r], min_p[r], u[r], s);
  });
}

// Each row's first index of its largest value, and that value: torch.max(dim=-1)'s answer (ties go to the first
// index; a row holding NaN answers its first NaN). Why ours: torch's takes ~47 us for one row of 49,152 logits
// and ~1.9 ms for 64 rows on a 2-core Zen 4 (its indexed reduction is not vectorised), at every greedy step.
// Here two vectorised passes over the row, the second stopping at the answer.
void argmax_rows(const float* logits, int64_t B, int64_t V, float* top, int64_t* idx) {
  parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits + r * V;
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#ifdef __AVX512F__
      __m512 vm = _mm512_set1_ps(m);
      __mmask16 unordered = 0;
      for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
      }
      nan = unordered != 0;
      m = _mm512_reduce_max_ps(vm);
#endif
      for (; i < V; ++i) {
        if (x[i] != x[i])
          nan = true;
        else if (x[i] > m)
          m = x[i];
      }
      int64_t j = 0, found = -1;
#ifdef __AVX512F__
      const __m512 target = _mm512_set1_ps(m);
      for (; j + 16 <= V && found < 0; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) found = j + __builtin_ctz(static_cast<unsigned>(hit));
      }
#endif
      for (; j < V && found < 0; ++j)
        if (nan ? x[j] != x[j] : x[j] == m) found = j;
      idx[r] = found;
      top[r] = x[found];
    }
  });
}

void register_sampler(Table& t) {
  t.sample_rows = &sample_rows;
  t.argmax_rows = &argmax_rows;
}

}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
