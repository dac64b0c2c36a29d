"""POST /v1/embeddings: each input's pooled hidden state, L2-normalized, through the same engine.

Every input becomes one engine pooling request (a prefill only, whose KV blocks are freed as soon as
its prompt is computed), so embeddings share the continuous batch with generation. The vector is the
final hidden state (after the model's last norm) at the input's last token: with causal attention
only that position has read the whole input, which is why vLLM pools decoder models that way by
default (mean pooling would weight the early positions, which saw only a prefix).
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import Request
from starlette.responses import Response

from llmserve.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from llmserve.entrypoints.openai.serving import ApiError, ServerContext, json_response, until_disconnected


class EmbeddingHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    @property
    def dimensions(self) -> int:
        return self.ctx.engine.config.model.arch.hidden_size

    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model, adapters=False)  # embeddings run the base model only
        if request.dimensions is not None and request.dimensions != self.dimensions:
            raise ApiError(
                f"dimensions={request.dimensions} is not supported: this model's embeddings have "
                f"{self.dimensions} dimensions and cannot be shortened",
                param="dimensions",
            )
        prompts = [ctx.encode_prompt(prompt, param="input") for prompt in request.inputs()]
        release = ctx.admit(len(prompts))
        try:
            vectors = await until_disconnected(raw_request, self._embed(prompts, request.priority))
        finally:
            release()
        data = [
            EmbeddingData(embedding=_encode(vector, request.encoding_format), index=index)
            for index, vector in enumerate(vectors)
        ]
        tokens = sum(map(len, prompts))
        return json_response(
            EmbeddingResponse(
                data=data,
                model=ctx.served_model_name,
                usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
            )
        )

    async def _embed(self, prompts: list[list[int]], priority: int) -> list[list[float]]:
        request_id = self.ctx.new_request_id("embd")
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        engine = self.ctx.engine
        return await asyncio.gather(
            *(engine.embed(prompt, rid, priority) for prompt, rid in zip(prompts, ids, strict=True))
        )


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
