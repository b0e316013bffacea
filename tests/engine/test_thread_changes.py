"""Changing the compute thread count between steps (conveyor/runner/cores.py does it when other processes take
cores) changes no token."""

from __future__ import annotations

import torch

from conveyor import LLM, SamplingParams


class Flipper:
    """Stands in for the governor: a different thread count at every step."""

    def __init__(self) -> None:
        self.steps = 0

    def tick(self) -> int:
        self.steps += 1
        torch.set_num_threads(1 + self.steps % 2)
        return torch.get_num_threads()


def test_changing_the_thread_count_between_steps_changes_no_token(tmp_path_factory):
    from tests.conftest import build_tiny_llama

    # wide enough that the kernels split their work across threads
    path = build_tiny_llama(tmp_path_factory.mktemp("wide"), hidden_size=256, intermediate_size=1024,
                            num_attention_heads=8, num_key_value_heads=2)
    before = torch.get_num_threads()
    prompts = [[5 + i, 6, 7, 8, 9] * (1 + 7 * i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    try:
        fixed = LLM(str(path), max_model_len=512, threads=2, kv_cache_memory=0.05)
        assert fixed.engine.info.batch_invariant
        want = [o.outputs[0].token_ids for o in fixed.generate(prompts, params, use_tqdm=False)]
        del fixed
        flipping = LLM(str(path), max_model_len=512, threads=2, kv_cache_memory=0.05)
        flipper = Flipper()
        flipping.engine.runner.cores = flipper
        got = [o.outputs[0].token_ids for o in flipping.generate(prompts, params, use_tqdm=False)]
    finally:
        torch.set_num_threads(before)
    assert flipper.steps >= 24
    assert got == want
