"""Sampling defaults from the model (vLLM's `--generation-config`), used when a request sets none."""

from __future__ import annotations

import json

import pytest

from conveyor import LLM
from conveyor.model.loader import default_sampling


def test_defaults_come_from_generation_config(tmp_path, tiny_llama):
    folder = tmp_path / "gc"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.8, "do_sample": True,
                                                                "max_new_tokens": 5}))
    assert default_sampling(str(tiny_llama), str(folder)) == {"temperature": 0.3, "top_p": 0.8}
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert default_sampling(str(tiny_llama), str(folder)) == {"temperature": 0.0}  # greedy, as transformers
    assert default_sampling(str(tiny_llama), "vllm") == {}
    assert default_sampling("smollm2-135m") == {"temperature": 0.2, "top_p": 0.9}  # the model card's
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling(str(tiny_llama), str(tmp_path / "nowhere"))


def test_llm_uses_them_when_given_no_params(tmp_path, tiny_llama):
    folder = tmp_path / "greedy"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, max_model_len=128, generation_config=str(folder))
    assert llm.get_default_sampling_params().temperature == 0.0
    a = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    assert a == b  # greedy by the model's defaults, not sampled at temperature 1
