"""Random PEFT LoRA adapters made on the spot, saved as a user's training run would save them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, out: Path, r: int, targets: list[str], seed: int, alpha: float | None = None,
                 rslora: bool = False, scale: float = 1.0, base_model=None) -> Path:
    """A LoRA adapter with random, non-zero A and B (PEFT's `init_lora_weights=False`), B scaled by
    `scale`, saved with `save_pretrained` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = base_model if base_model is not None else AutoModelForCausalLM.from_pretrained(
        str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                     init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.save_pretrained(str(out))
    peft_model.unload()  # the base model's modules back as they were (it may be reused)
    return out


def merged_reference(base_dir: Path, adapter_dir: Path):
    """HF transformers + peft: the adapter merged into a fresh copy of the base (`merge_and_unload`), fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
