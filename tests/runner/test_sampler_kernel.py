"""The compiled sampler (`sample_rows`, no sort) against the pure-torch reference (`sample_reference`).

Given the same uniform numbers both must pick the same tokens, and the kernel's draws must follow
the reference's probabilities (a chi-square test, with a control showing that the test rejects a
distribution that ignores a cut-off).
"""

from __future__ import annotations

import pytest
import torch

from conveyor import kernels
from conveyor.runner.sampler import kept_mask, sample_reference

scipy_stats = pytest.importorskip("scipy.stats")

kern = kernels.load()
pytestmark = pytest.mark.skipif(kern is None or not hasattr(kern, "sample_rows"), reason="compiled kernels unavailable")

CASES = {  # temperature, top_k, top_p, min_p
    "top_p": (0.2, 0, 0.9, 0.0),
    "top_p_flat": (1.0, 0, 0.9, 0.0),
    "temperature_only": (1.0, 0, 1.0, 0.0),
    "top_k": (1.0, 50, 1.0, 0.0),
    "min_p": (1.0, 0, 1.0, 0.1),
    "all": (0.7, 40, 0.8, 0.05),
    "tiny_p": (1.0, 0, 1e-6, 0.0),
    "k_above_vocab": (1.5, 10**6, 0.95, 0.0),
}


def params(b: int, temperature: float, top_k: int, top_p: float, min_p: float):
    return (torch.full((b,), temperature), torch.full((b,), top_k, dtype=torch.long), torch.full((b,), top_p),
            torch.full((b,), min_p))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("vocab", [49152, 1003])
def test_kernel_picks_the_reference_token(case, vocab):
    torch.manual_seed(7)
    b = 16
    x = torch.randn(b, vocab) * 3
    x[::7, ::5] = float("-inf")  # grammar- or bias-masked tokens
    p = params(b, *CASES[case])
    u = torch.rand(b, dtype=torch.float64)
    got = kern.sample_rows(x, *p, u)
    want = sample_reference(x, *p, u)
    # the same token, except where u falls within float rounding of a cumulative sum (never seen here)
    assert (got == want).float().mean().item() >= 15 / 16, (got, want)
    keep = kept_mask(x / p[0][:, None], p[1], p[2], p[3])
    assert keep.gather(1, got[:, None]).all(), "the kernel drew a token the reference's cut-offs drop"


def test_ties_and_one_token_rows():
    x = torch.zeros(4, 64)
    x[1, 5] = 1.0
    x[2] = float("-inf")
    x[2, 9] = 0.0  # only one finite token
    x[3, :3] = 2.0  # a three-way tie for the best
    p = params(4, 1.0, 2, 1.0, 0.0)
    u = torch.tensor([0.0, 0.5, 0.99, 0.999], dtype=torch.float64)
    got = kern.sample_rows(x, *p, u).tolist()
    assert got[2] == 9
    assert got[3] in (0, 1, 2)  # top-k 2 keeps the whole tie, as `x >= kth` does
    assert got == sample_reference(x, *p, u).tolist()


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    x = (logits / temperature)[None]
    keep = kept_mask(x, *(t for t in params(1, temperature, top_k, top_p, min_p)[1:]))
    return x.masked_fill(~keep, float("-inf")).softmax(-1)[0].double()


class OutsideSupport(AssertionError):
    """A drawn token has probability 0 under the distribution tested against."""


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square over the tokens with expected count >= 5 (the rest pooled into one bin)."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # a near-empty pooled bin: fold it into the largest
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmax()] += counts[~big].sum()
        exp[exp.argmax()] += expected[~big].sum()
    if probs[tokens].min() <= 0:
        raise OutsideSupport("a drawn token lies outside the distribution")
    return float(scipy_stats.chisquare(obs.numpy(), exp.numpy() * (n / exp.sum().item())).pvalue)


@pytest.mark.parametrize("case", ["top_p", "top_p_flat", "top_k", "min_p", "all"])
def test_draws_follow_the_reference_distribution(case):
    """20,000 draws from one row (as 20,000 rows in one call) against the reference's probabilities."""
    temperature, top_k, top_p, min_p = CASES[case]
    g = torch.Generator().manual_seed(11)
    vocab, n = 400, 20_000
    row = torch.randn(vocab, generator=g) * (1.0 if temperature < 0.5 else 2.5)
    logits = row.repeat(n, 1)
    u = torch.rand(n, dtype=torch.float64, generator=g)
    tokens = kern.sample_rows(logits, *params(n, temperature, top_k, top_p, min_p), u)
    probs = reference_probs(row, temperature, top_k, top_p, min_p)
    assert chi2_pvalue(tokens, probs) > 1e-4
    # the control: the same draws against a slightly different distribution (temperature 15% higher, the
    # same cut-offs) are rejected outright, so this test tells a right sampler from a slightly wrong one
    try:
        control = chi2_pvalue(tokens, reference_probs(row, temperature * 1.15, top_k, top_p, min_p))
    except OutsideSupport:
        control = 0.0
    assert control < 1e-6


def argmax_cases() -> dict[str, torch.Tensor]:
    """Rows that probe torch.max's rules: ties (first index wins), -0.0 against 0.0, infinities, NaN (propagates,
    first NaN), all -inf (a fully banned row), widths that leave a tail after the 16-wide vectors."""
    g = torch.Generator().manual_seed(3)
    rows = {}
    for vocab in (49152, 1003, 17, 1):
        x = torch.randn(6, vocab, generator=g)
        if vocab > 1:
            x[1, vocab // 3] = x[1, vocab - 1] = 50.0  # a tie: the first index
            x[2, :] = -float("inf")
            x[2, vocab - 1] = 0.0
            x[3, vocab // 2] = float("inf")
            x[4, vocab - 1] = float("nan")
            x[4, vocab // 4] = float("nan")
            x[4, 0] = float("inf")
        x[5, :] = -float("inf")
        rows[f"v{vocab}"] = x
    x = torch.zeros(3, 40)
    x[0, 5] = -0.0
    x[1, :] = -0.0
    x[1, 20] = 0.0
    rows["signed_zeros"] = x
    rows["banned_bf16_logits"] = torch.randn(64, 49152, generator=g).bfloat16().float()  # many exact ties
    return rows


@pytest.mark.parametrize("name", list(argmax_cases()))
def test_argmax_rows_is_torch_max(name):
    x = argmax_cases()[name]
    top, idx = kern.argmax_rows(x)
    ref_top, ref_idx = x.max(dim=-1)
    assert torch.equal(idx, ref_idx), (idx, ref_idx)
    assert torch.equal(top.isnan(), ref_top.isnan())
    finite = ~ref_top.isnan()
    assert torch.equal(top[finite], ref_top[finite])


def test_argmax_cases_tell_first_from_last():
    """The tie rows are real ties: an argmax that took the last maximal index instead of the first would give
    other indices there, so the comparison above would fail for it."""
    x = argmax_cases()["v1003"]
    last = x.shape[1] - 1 - x.flip(-1).max(dim=-1).indices
    assert not torch.equal(last, x.max(dim=-1).indices)
