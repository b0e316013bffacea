"""Hugging Face transformers as the reference implementation the engine is checked against."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF's own greedy `generate`, with EOS disabled so exactly `n` tokens come back (like ignore_eos)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    toks = out[0, len(prompt):].tolist()
    assert len(toks) == n, "HF stopped early: the reference must ignore EOS"
    return toks


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """HF's float32 logits for every position of one prompt: [len(ids), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_model_from_gguf(path: Path):
    """HF's LlamaForCausalLM with the weights HF itself reads (dequantizes, un-permutes) from a GGUF.

    `from_pretrained(gguf_file=...)` needs `accelerate`; without it, the same HF GGUF reader fills a
    model built from the GGUF's config, which is the path from_pretrained takes internally.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with no_init_weights():  # every weight is overwritten below; random init only costs seconds
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()},
                                                strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
