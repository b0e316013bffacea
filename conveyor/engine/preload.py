"""Imported once by the forkserver that engine processes are forked from (`clients.process_context`).

Everything an engine build imports, including what it imports lazily the first time: the HF
tokenizer and config classes (transformers pulls in torch.distributed.tensor on the way), and
torch._dynamo (torch.nn.init goes through torch.compile's wrapper, which imports it). These imports
are most of a fresh engine process's start; done here, a restarted engine process pays only for
its model. Only imports: nothing here may start a thread (an OpenMP team, a tokenizer pool), since
the forkserver forks after it.
"""

import gc

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
from transformers.models.llama import configuration_llama  # noqa: F401

import conveyor.engine.clients  # noqa: F401 - the engine, model, runner, scheduler and kernels' Python side

# The forkserver's heap (a few hundred thousand objects of torch and transformers) is inherited by every
# engine process: frozen, the collector never walks it there (an engine build collects garbage twice, each
# pass ~0.4 s over this heap) nor writes to its pages (which would copy them, page by page, into each child).
gc.collect()
gc.freeze()
