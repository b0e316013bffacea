"""/v1/embeddings: OpenAI's request and response on top of the engine's prefill-only embedding requests.

Every input becomes one engine request with `PoolingParams` (`conveyor/pooling.py`); they are queued,
scheduled and batched with generations like any request, and each comes back as one final delta
carrying its vector. Bad input (empty, too long, token ids outside the vocabulary, `dimensions`
wider than the model) is a 400 before anything reaches the engine. The per-request fields (the tenant by
the server's rule, priority, cache salt, latency targets) become the engine's record as for completions
and chat (`OpenAIServing.engine_requests`); the vectors are the base model's, whatever `model` names.
"""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from conveyor.pooling import PoolingParams
from conveyor.sampling_params import SamplingParams
from conveyor.server import protocol as P
from conveyor.server.async_engine import EngineDeadError
from conveyor.server.http import ApiError, bad_request, engine_error, wait_disconnect
from conveyor.server.serving import OpenAIServing, parse_model

MAX_INPUTS = 2048  # as OpenAI


class OpenAIServingEmbedding(OpenAIServing):
    async def _inputs(self, given) -> list[list[int]]:
        if isinstance(given, str):
            given = [given]
        if not given:
            raise bad_request("input must not be empty", "input")
        if isinstance(given[0], int):
            given = [given]
        if len(given) > MAX_INPUTS:
            raise bad_request(f"input may hold at most {MAX_INPUTS} inputs, got {len(given)}", "input")
        out = []
        for x in given:
            if isinstance(x, str):
                if not x:
                    raise bad_request("input must not contain empty strings", "input")
                ids = await self.tokenize(x, True, "input")
            else:
                ids = list(x)
            if not ids:
                raise bad_request("input must not contain empty token lists", "input")
            if len(ids) >= self.max_model_len:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"an input has {len(ids)} tokens. Please reduce the length of the input.", "input")
            if any(t >= self.vocab_size for t in ids):
                raise bad_request(f"input token ids must be below the vocabulary size ({self.vocab_size})", "input")
            out.append(ids)
        return out

    async def create(self, data: dict, request: Request) -> Response:
        req = parse_model(P.EmbeddingRequest, data)
        self.check_model(req.model)
        hidden = self.info.hidden_size
        if req.dimensions is not None and hidden and req.dimensions > hidden:
            raise bad_request(f"dimensions ({req.dimensions}) is larger than this model's embedding size ({hidden})",
                              "dimensions")
        inputs = await self._inputs(req.input)
        pooling = PoolingParams(self.options.pooling or "last", req.dimensions)
        params = SamplingParams(max_tokens=1, temperature=0.0)  # nothing is sampled: pooled at the prompt's end
        api_id = f"embd-{uuid.uuid4().hex}"
        sub = self.submit(api_id, self.engine_requests(api_id, inputs, params, req, request.headers,
                                                                       pooling=pooling))
        index = {inp.request_id: i for i, inp in enumerate(sub.inputs)}
        vectors: list[list[float] | None] = [None] * len(inputs)
        errors: list[str] = []

        async def run() -> None:
            async for d in self.deltas(sub):
                if d.error:
                    errors.append(d.error)
                if d.embedding is not None:
                    vectors[index[d.group_id]] = d.embedding

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            sub.close()  # aborts whatever is unfinished: its blocks are freed
        if work not in done:
            return Response(status_code=499)
        try:
            work.result()
        except EngineDeadError as e:
            raise engine_error(e) from None
        except (TimeoutError, asyncio.TimeoutError):
            raise self.timeout_error() from None
        if errors or any(v is None for v in vectors):
            raise ApiError(500, f"the request failed in the engine: {errors[0] if errors else 'aborted'}",
                           "internal_error", code="request_failed")
        data_out = []
        for i, v in enumerate(vectors):
            emb = (base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if req.encoding_format == "base64"
                   else v)
            data_out.append(P.EmbeddingData(index=i, embedding=emb))
        tokens = sum(len(ids) for ids in inputs)
        metrics = self.aengine.metrics
        if metrics is not None:
            metrics.observe_embeddings(len(inputs), tokens)
        body = P.EmbeddingResponse(id=api_id, model=req.model or self.model_names[0], data=data_out,
                                   usage=P.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
        return Response(body.model_dump_json(), media_type="application/json")
