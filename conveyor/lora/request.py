"""`LoRARequest`: which adapter a request runs under, with vLLM's class and field names.

    from conveyor.lora import LoRARequest
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

vLLM's is `vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)`; code written for it
works here unchanged. `lora_int_id` is the adapter's identity inside the engine (>= 1, as in vLLM):
two requests with the same id run the same loaded weights.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must name the adapter's directory")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
