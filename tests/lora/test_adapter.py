"""Loading PEFT adapter directories: what is accepted, and a clear error for everything else."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor import LLM, SamplingParams
from conveyor.lora import AdapterError, LoRARequest, LoRASpec, load_adapter
from conveyor.model.llama import ModelConfig
from tests.lora.peft_adapters import make_adapter


@pytest.fixture(scope="module")
def good(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("good") / "ad", 8, ["q_proj", "up_proj"], seed=1,
                        alpha=4, rslora=True)


@pytest.fixture(scope="module")
def spec(tiny_llama) -> LoRASpec:
    return LoRASpec.for_model(ModelConfig.from_hf(json.loads((tiny_llama / "config.json").read_text())), 16)


def test_loads_with_peft_scaling(good, spec):
    ad = load_adapter(good, spec, "good")
    assert ad.rank == 8 and ad.targets == ("q_proj", "up_proj")
    assert ad.scaling == pytest.approx(4 / 8 ** 0.5)  # rsLoRA: alpha / sqrt(r)
    raw = load_file(str(good / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    torch.testing.assert_close(ad.weights[(1, "up_proj")][1], b * ad.scaling)
    assert len(ad.weights) == 2 * 2  # two layers, two projections


def _copy(good, tmp_path, name="bad"):
    d = tmp_path / name
    shutil.copytree(good, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case,message", [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("no-config", "has no adapter_config.json"),
    ("bad-json", "not valid JSON"),
    ("no-weights", "has no adapter_model.safetensors"),
    ("rank", "rank 32 is above --max-lora-rank 16"),
    ("dora", "DoRA"),
    ("modules-to-save", "modules_to_save"),
    ("target", "target_modules ['lm_head'] are not supported"),
    ("shape", "this base model and r=8 need"),
    ("stray-tensor", "is not a LoRA A/B matrix"),
    ("half-pair", "has no lora_B weight"),
    ("truncated", "could not be read"),
])
def test_bad_adapters_are_refused_with_a_reason(good, spec, tmp_path, case, message):
    d = tmp_path / "bad"
    weights = d / "adapter_model.safetensors"
    if case == "missing":
        d = tmp_path / "nowhere"
    elif case == "file":
        d.write_text("x")
    else:
        _copy(good, tmp_path)
    if case == "no-config":
        (d / "adapter_config.json").unlink()
    elif case == "bad-json":
        (d / "adapter_config.json").write_text("{not json")
    elif case == "no-weights":
        weights.unlink()
    elif case == "rank":
        _edit_config(d, r=32)
    elif case == "dora":
        _edit_config(d, use_dora=True)
    elif case == "modules-to-save":
        _edit_config(d, modules_to_save=["lm_head"])
    elif case == "target":
        _edit_config(d, target_modules=["q_proj", "lm_head"])
    elif case in ("shape", "stray-tensor", "half-pair"):
        t = load_file(str(weights))
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
        if case == "shape":
            t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])
        elif case == "stray-tensor":
            t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        else:
            del t[key]
        save_file(t, str(weights))
    elif case == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_adapter(d, spec, "bad")


def test_engine_refuses_a_bad_adapter_and_keeps_serving(tiny_llama, good, tmp_path):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    bad = LoRARequest("bad", 2, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(prompts, params, use_tqdm=False, lora_request=[None, bad])
    assert not llm.engine.has_unfinished_requests()  # nothing of the failed call was queued
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("good", 1, str(good)))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


@pytest.mark.parametrize("case", ["missing", "rank", "malformed-config", "no-weights", "not-a-directory"])
def test_engine_refuses_each_bad_adapter_before_queueing_and_keeps_serving(tiny_llama, good, tmp_path, case):
    """The issue's error criteria offline: each bad adapter fails the whole `generate` call with its reason
    and queues nothing; the same engine then serves the base model and a good adapter."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, enable_lora=True,
              max_lora_rank=4 if case == "rank" else 16)
    d = tmp_path / "bad"
    if case != "missing":
        shutil.copytree(good, d)
    if case == "malformed-config":
        (d / "adapter_config.json").write_text("{not json")
    elif case == "no-weights":
        (d / "adapter_model.safetensors").unlink()
    elif case == "not-a-directory":
        shutil.rmtree(d)
        d.write_text("a file")
    message = {"missing": "does not exist", "rank": "rank 8 is above --max-lora-rank 4",
               "malformed-config": "not valid JSON", "no-weights": "adapter_model",
               "not-a-directory": "is not a directory"}[case]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False, lora_request=[None, LoRARequest("bad", 2, str(d))])
    assert not llm.engine.has_unfinished_requests() and llm.engine.list_loras() == []
    small = make_adapter(tiny_llama, tmp_path / "small", 4, ["v_proj"], seed=3)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[None, LoRARequest("small", 1, str(small))])
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_lora_off_refuses_lora_requests(tiny_llama, good):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, max_model_len=256)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("good", 1, str(good)))


def test_lora_request_fields_are_vllms():
    r = LoRARequest("sql", 3, "/x")
    assert (r.lora_name, r.lora_int_id, r.lora_path, r.adapter_id) == ("sql", 3, "/x", 3)
    with pytest.raises(ValueError):
        LoRARequest("sql", 0, "/x")
