"""conveyor: an LLM inference server with four batching strategies on one paged-KV engine."""

from conveyor.config import EngineConfig
from conveyor.llm import LLM
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "__version__"]
