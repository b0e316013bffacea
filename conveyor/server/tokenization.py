"""vLLM's /tokenize and /detokenize on the shared serving base: the server's own tokenizer and chat template."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from conveyor.server import protocol as P
from conveyor.server import tools as T
from conveyor.server.http import bad_request
from conveyor.server.serving import OpenAIServing, parse_model


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize_endpoint(self, data: dict) -> Response:
        """vLLM's POST /tokenize: {"count", "max_model_len", "tokens"}."""
        req = parse_model(P.TokenizeRequest, data)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty", "messages")
            chat = P.ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                           tools=req.tools)
            ids = await self.render_chat(chat, T.ToolPlan("none", req.tools or []).template_tools())
        else:
            if len(req.prompt) > self.ctx.max_prompt_chars:
                raise bad_request("prompt is longer than this model's context could hold", "prompt")
            ids = await self.tokenize(req.prompt, req.add_special_tokens, "prompt")
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def detokenize_endpoint(self, data: dict) -> Response:
        """vLLM's POST /detokenize: {"prompt": text}."""
        req = parse_model(P.DetokenizeRequest, data)
        self.check_model(req.model)
        if any(t >= self.vocab_size for t in req.tokens):
            raise bad_request(f"tokens must be below the vocabulary size ({self.vocab_size})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})
