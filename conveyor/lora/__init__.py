"""Many LoRA adapters of one base model, served side by side in one batch (see docs/lora.md)."""

from conveyor.lora.request import LoRARequest

__all__ = ["AdapterError", "LoRARequest", "LoRASpec", "check_adapter", "load_adapter"]


def __getattr__(name: str):
    """The adapter loader needs torch; `LoRARequest` alone (imported by `conveyor.request`) does not."""
    if name in ("AdapterError", "LoRAAdapter", "LoRASpec", "check_adapter", "load_adapter"):
        from conveyor.lora import adapter

        return getattr(adapter, name)
    raise AttributeError(f"module 'conveyor.lora' has no attribute {name!r}")
