"""Workloads are deterministic and keep the lengths they promise."""

from __future__ import annotations

import statistics

import pytest

from conveyor.bench.workloads import WorkloadSpec, arrival_offsets, generate

VOCAB = 49152


def test_same_seed_same_requests_other_seed_differs() -> None:
    spec = WorkloadSpec("random", num_prompts=20, input_len=50, output_len=20, range_ratio=0.5, seed=3)
    a, b = generate(spec, VOCAB), generate(spec, VOCAB)
    assert a == b
    c = generate(WorkloadSpec("random", num_prompts=20, input_len=50, output_len=20, range_ratio=0.5, seed=4), VOCAB)
    assert a != c


def test_random_lengths_within_range_ratio() -> None:
    reqs = generate(WorkloadSpec("random", num_prompts=200, input_len=100, output_len=40, range_ratio=0.25), VOCAB)
    assert all(75 <= r.prompt_len <= 125 and 30 <= r.max_tokens <= 50 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10
    fixed = generate(WorkloadSpec("random", num_prompts=5, input_len=100, output_len=40), VOCAB)
    assert all(r.prompt_len == 100 and r.max_tokens == 40 for r in fixed)


def test_token_ids_avoid_special_ids() -> None:
    reqs = generate(WorkloadSpec("random", num_prompts=30, input_len=64, output_len=4), VOCAB)
    ids = [t for r in reqs for t in r.prompt_token_ids]
    assert min(ids) >= 100 and max(ids) < VOCAB
    small = generate(WorkloadSpec("random", num_prompts=5, input_len=64, output_len=4), 150)
    assert all(0 < t < 150 for r in small for t in r.prompt_token_ids)


def test_longtail_is_mostly_short_with_a_long_tail() -> None:
    reqs = generate(WorkloadSpec("longtail", num_prompts=500, seed=1), VOCAB)
    long = [r for r in reqs if r.prompt_len >= 512]
    assert 0.12 < len(long) / len(reqs) < 0.28
    assert all(32 <= r.prompt_len <= 128 and 32 <= r.max_tokens <= 128 for r in reqs if r.prompt_len < 512)
    assert all(r.prompt_len <= 1500 and 128 <= r.max_tokens <= 384 for r in long)
    lens = [r.prompt_len for r in reqs]
    assert statistics.mean(lens) > statistics.median(lens)  # skewed right


def test_shared_prefix_shares_the_system_prompt() -> None:
    reqs = generate(WorkloadSpec("shared-prefix", num_prompts=10, prefix_len=64, input_len=16, output_len=8), VOCAB)
    prefix = reqs[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix and r.prompt_len == 80 for r in reqs)
    assert len({tuple(r.prompt_token_ids[64:]) for r in reqs}) == 10


def test_shared_prefix_with_several_system_prompts_takes_them_in_turn() -> None:
    one = generate(WorkloadSpec("shared-prefix", num_prompts=6, prefix_len=32, input_len=8, output_len=4), VOCAB)
    three = generate(WorkloadSpec("shared-prefix", num_prompts=6, prefix_len=32, input_len=8, output_len=4,
                                  num_prefixes=3), VOCAB)
    heads = [tuple(r.prompt_token_ids[:32]) for r in three]
    assert heads[:3] == heads[3:] and len(set(heads)) == 3
    assert heads[0] == tuple(one[0].prompt_token_ids[:32])  # the first system prompt is the one-prefix workload's
    with pytest.raises(ValueError, match="num_prefixes"):
        WorkloadSpec("shared-prefix", num_prefixes=0)


def test_max_model_len_clips_prompt_first() -> None:
    reqs = generate(WorkloadSpec("random", num_prompts=5, input_len=300, output_len=50), VOCAB, max_model_len=256)
    assert all(r.prompt_len + r.max_tokens <= 256 and r.max_tokens == 50 for r in reqs)


def test_arrivals_poisson_rate_and_determinism() -> None:
    offs = arrival_offsets(4000, request_rate=8.0, seed=1)
    assert offs == arrival_offsets(4000, request_rate=8.0, seed=1)
    assert offs[0] == 0.0 and offs == sorted(offs)
    assert 4000 / offs[-1] == pytest.approx(8.0, rel=0.08)
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    bursty = arrival_offsets(4000, 8.0, burstiness=0.25, seed=1)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.pstdev(bgaps) > 1.5 * statistics.pstdev(gaps)  # same mean, burstier
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [dict(name="nope"), dict(range_ratio=1.0), dict(num_prompts=0),
                                 dict(short_input=(10, 5))])
def test_bad_specs_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(**bad)


def test_noisy_neighbour_sends_the_ratio_from_two_tenants() -> None:
    reqs = generate(WorkloadSpec("noisy-neighbour", num_prompts=900, input_len=40, output_len=10), VOCAB)
    counts = {t: sum(r.tenant == t for r in reqs) for t in ("noisy", "quiet")}
    assert counts["noisy"] + counts["quiet"] == 900
    assert 6.5 <= counts["noisy"] / counts["quiet"] <= 10, counts  # 8x, within sampling noise
    assert all(r.slo_ttft_ms is None for r in reqs)


def test_mixed_slo_gives_chat_tight_and_batch_loose_targets() -> None:
    spec = WorkloadSpec("mixed-slo", num_prompts=300, long_fraction=0.25, chat_ttft_ms=500, chat_tpot_ms=80,
                        batch_ttft_ms=20000)
    reqs = generate(spec, VOCAB)
    chat = [r for r in reqs if r.tenant == "chat"]
    batch = [r for r in reqs if r.tenant == "batch"]
    assert len(chat) + len(batch) == 300 and 50 <= len(batch) <= 100
    assert all(r.slo_ttft_ms == 500 and r.slo_tpot_ms == 80 and r.prompt_len <= 128 for r in chat)
    assert all(r.slo_ttft_ms == 20000 and r.slo_tpot_ms is None and r.prompt_len >= 512 for r in batch)
