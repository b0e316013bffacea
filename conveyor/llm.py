"""The offline API, shaped like vLLM's so a user can switch in one line.

    from conveyor import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.output_processor import RequestOutputBuilder, request_metrics
from conveyor.lora.request import LoRARequest
from conveyor.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from conveyor.pooling import PoolingParams, default_pooling
from conveyor.request import make_request
from conveyor.sampling_params import SamplingParams
from conveyor.startup import loading_progress

PromptType = str | dict | list[int]


class LLM:
    def __init__(self, model: str = "smollm2-135m", use_tqdm_on_load: bool = True, **kwargs) -> None:
        """`use_tqdm_on_load` (vLLM's name): show what the load is doing (weights, a first kernel compile, the KV
        pool) on stderr while it runs. The model is built on this thread, which also steps it."""
        config = EngineConfig(model=model, **kwargs)
        with loading_progress(f"Loading {model}", enabled=use_tqdm_on_load):
            self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the model's recommended sampling
        (`generation_config`), as vLLM's `LLM.get_default_sampling_params`."""
        return self.engine.info.request_defaults.sampling_params()

    def _to_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.engine.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._to_ids(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        tenant: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order.

        `priority`: one per prompt, lower first (vLLM's); `tenant`: one name for all prompts or one per
        prompt (None: the default tenant), for strategies that share the machine between tenants;
        `lora_request`: one adapter for every prompt or one (or None: the base model) per prompt, as vLLM's."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        tenants = [tenant] * len(prompts) if tenant is None or isinstance(tenant, str) else list(tenant)
        if len(tenants) != len(prompts):
            raise ValueError("tenant must be one name or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must have one entry per prompt")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request must be one LoRARequest or one per prompt")
        encoded = [self._to_ids(p) for p in prompts]  # validate everything before queueing anything
        for (_, ids), sp in zip(encoded, param_list):
            self.engine.validate_prompt(ids, sp)
        defaults = self.engine.info.request_defaults
        records = [make_request(ids, sp, defaults=defaults, priority=priority[i] if priority else 0, tenant=tenants[i],
                                lora_request=loras[i]) for i, ((_, ids), sp) in enumerate(zip(encoded, param_list))]
        for lora in {lr for lr in loras if lr is not None}:  # a bad adapter fails the call before anything is queued
            self.engine.load_lora(lora)
        builders: dict[str, RequestOutputBuilder] = {}
        requests = {}
        for (text, ids), sp, record in zip(encoded, param_list, records):
            reqs = self.engine.add_request(record)
            gid = reqs[0].group_id
            builders[gid] = RequestOutputBuilder(gid, sp.n, text, ids, logprobs=sp.logprobs is not None)
            requests[gid] = reqs
        # one request: a bar of its tokens (up to max_tokens); several: a bar of finished requests
        tokens = param_list[0].max_tokens * param_list[0].n if len(builders) == 1 and param_list[0].max_tokens else None
        self._run(builders, use_tqdm, tokens)
        outs = []
        for gid, b in builders.items():
            b.metrics = request_metrics(requests[gid])
            outs.append(b.build())
        return outs

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (vLLM's `LLM.embed`): `outputs[i].outputs.embedding` is its pooled, L2-normalised
        last hidden state (`conveyor/pooling.py`; default pooling: the model's own, else the last token).
        Runs through the same scheduler as `generate`, prefill only."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        pooling = pooling_params or PoolingParams(default_pooling(self.engine.config.model))
        encoded = [self._to_ids(p) for p in prompts]
        for _, ids in encoded:
            self.engine.validate_prompt(ids)
        defaults = self.engine.info.request_defaults
        order = [self.engine.add_request(make_request(ids, SamplingParams(max_tokens=1), defaults=defaults,
                                                      pooling=pooling))[0].request_id for _, ids in encoded]
        got: dict[str, list[float]] = {}
        self.engine.end_input()
        while self.engine.has_unfinished_requests():
            for d in self.engine.step().deltas:
                if d.embedding is not None:
                    got[d.request_id] = d.embedding
        return [EmbeddingRequestOutput(rid, ids, EmbeddingOutput(got[rid])) for rid, (_, ids) in zip(order, encoded)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not conversation:
            raise ValueError("messages must not be empty")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        out = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def _run(self, builders: dict[str, RequestOutputBuilder], use_tqdm: bool, max_tokens: int | None = None) -> None:
        """Step until every request is done, feeding each step's deltas to its request's builder.
        `max_tokens`: one request's most output tokens, for a bar of tokens rather than of requests."""
        total = sum(len(b.outputs) for b in builders.values())
        self.engine.end_input()  # offline: a static batcher may run its last, partial batch
        bar = None
        by_tokens = total == 1 and max_tokens is not None
        if use_tqdm and (total > 1 or by_tokens):
            from tqdm.auto import tqdm

            bar = (tqdm(total=max_tokens, desc="Generating", unit="tok", dynamic_ncols=True) if by_tokens
                   else tqdm(total=total, desc="Processed requests", unit="req", dynamic_ncols=True))
        start, out_tokens = time.monotonic(), 0
        try:
            while self.engine.has_unfinished_requests():
                deltas = self.engine.step().deltas
                for d in deltas:
                    builders[d.group_id].add(d)
                out_tokens += sum(len(d.new_token_ids) for d in deltas)
                if bar is not None:
                    new = sum(len(d.new_token_ids) for d in deltas)
                    done = new if by_tokens else sum(1 for d in deltas if d.finished)
                    bar.set_postfix_str(f"output {out_tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s",
                                        refresh=False)
                    bar.update(done)
        finally:
            if bar is not None:
                bar.close()
