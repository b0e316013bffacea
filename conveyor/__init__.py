"""conveyor: an LLM inference server with four batching strategies on one paged-KV engine."""

from conveyor.config import EngineConfig
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig",
           "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    """`conveyor.LLM` is imported on first use: the CLI's light commands (`bench report`) need no torch."""
    if name == "LLM":
        from conveyor.llm import LLM

        return LLM
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
