"""The lab's arithmetic: latency percentiles, goodput, model FLOPs and MFU, KV waste.

Kept free of I/O and of the engine so each formula can be unit-tested on hand-made numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float, method: str = "linear") -> float | None:
    """The q-th percentile (q in percent), None for no data.

    `linear` interpolates between the two nearest samples (numpy's default), what the lab's reports use.
    `rank` is the sorted samples' element at index floor(q/100 * n) (the last one past the end): always a
    sample that occurred, what the studies in benchmarks/ have always reported (their docs' numbers are it).
    """
    if not values:
        return None
    xs = sorted(values)
    if method == "rank":
        return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]
    if method != "linear":
        raise ValueError(f"method must be 'linear' or 'rank', got {method!r}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (and max), the shape every latency is reported in."""
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    out["max"] = max(values) if values else None
    return out


def tpot(e2e: float, ttft: float, output_len: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (n - 1); undefined for one token."""
    return (e2e - ttft) / (output_len - 1) if output_len > 1 else None


def meets_slo(ttft: float | None, tpot_s: float | None, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """A request counts toward goodput only if every SLO that is set holds (a missing TPOT passes)."""
    if ttft is None:
        return False
    if slo_ttft_s is not None and ttft > slo_ttft_s:
        return False
    return not (slo_tpot_s is not None and tpot_s is not None and tpot_s > slo_tpot_s)


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs of a dense decoder, counted the way the runner executes it.

    Every processed token goes through every layer's linear layers (2 FLOPs per weight) and attends
    to its context (QK^T and AV: 2 * 2 * ctx * q_width per layer). The LM head runs only on rows
    that sample a token, as `ModelRunner.execute` does. Norms, RoPE and activations are ignored
    (well under 1% for these shapes). The embedding lookup is not a matmul and costs nothing here.
    """

    linear_params: int  # per-token matmul weights of all layers, excluding the LM head
    lm_head_params: int
    num_layers: int
    q_width: int  # num_heads * head_dim

    @classmethod
    def from_config(cls, cfg) -> FlopModel:
        """From a `conveyor.model.llama.ModelConfig` (duck-typed, so tests can pass a namespace)."""
        h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
        return cls(per_layer * cfg.num_layers, h * cfg.vocab_size, cfg.num_layers, q)

    def flops(self, processed_tokens: int, sampled_tokens: int, attention_ctx_sum: int) -> float:
        """Total FLOPs for `processed_tokens` fed through the model, `sampled_tokens` LM-head rows,
        and the sum over processed tokens of the number of keys each attended to."""
        return (2.0 * self.linear_params * processed_tokens + 2.0 * self.lm_head_params * sampled_tokens
                + 4.0 * self.num_layers * self.q_width * attention_ctx_sum)


def attention_ctx_sum(start: int, end: int) -> int:
    """Sum of context lengths for query positions start..end-1 (position p attends to p + 1 keys)."""
    if end <= start:
        return 0
    return (end * (end + 1) - start * (start + 1)) // 2


def request_work(prompt_len: int, output_len: int, cached_tokens: int = 0) -> tuple[int, int]:
    """(processed tokens, attention ctx sum) of one request run once: the prompt minus the cached
    prefix, then every output token but the last (which is sampled, never fed back)."""
    end = prompt_len + max(output_len - 1, 0)
    start = min(cached_tokens, prompt_len - 1)
    return end - start, attention_ctx_sum(start, end)


def measure_peak_flops(dtype=None, device=None, n: int = 2048, repeats: int = 5, budget_s: float = 10.0) -> float:
    """The machine's matmul FLOP/s as this process sees it: the best of a few n x n x n GEMMs.

    Measured in the lab itself (same dtype, device and thread count as the engine), so MFU compares
    the engine with what this box actually delivers, not a datasheet number.
    """
    import torch

    dtype = dtype or torch.float32
    device = torch.device(device or "cpu")
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    matmul = lambda: torch.matmul(a, b)  # noqa: E731
    if device.type == "cpu" and dtype == torch.bfloat16:
        # the engine's own bf16 linear (PackedLinear: oneDNN's prepacked GEMM or ours): where oneDNN cannot
        # pack bf16 (AVX2), torch.matmul emulates bf16 several times slower than the engine runs, and an
        # MFU against it came out above 1
        from conveyor.model.packed_linear import PackedLinear, packing_available

        if packing_available(device, dtype):
            lin = PackedLinear(torch.nn.Linear(n, n, bias=False).to(dtype))
            matmul = lambda: lin(a)  # noqa: E731
    matmul()  # warm-up: thread pool, allocator, kernel selection
    sync()
    best, deadline = math.inf, time.perf_counter() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul()
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return 2.0 * n ** 3 / best


def paged_waste(used_slots: int, used_blocks: int, block_size: int) -> float | None:
    """Fraction of allocated KV slots holding no token (the partly filled last blocks).

    `used_slots` counts physical slots, so a block shared through the prefix cache counts once.
    """
    cap = used_blocks * block_size
    return 1.0 - used_slots / cap if cap else None


def contiguous_waste(num_tokens: int, num_running: int, max_model_len: int) -> float | None:
    """The same step's waste had every running request reserved `max_model_len` contiguous slots
    up front (what servers without paging do, since the output length is unknown)."""
    cap = num_running * max_model_len
    return 1.0 - num_tokens / cap if cap else None


def measure_read_bandwidth() -> float:
    """Memory read bandwidth (bytes/s) of this machine: the best of 5 sums over 512 MiB, far past
    the caches. The denominator of memory-bandwidth utilization."""
    import time

    import torch

    a = torch.ones(2**27)
    a.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best
