"""POST /v1/generate: the design's minimal route, a thin layer over the same engine requests.

`{prompt, max_tokens, temperature, stream}` -> `{text, tokens_generated, latency_ms,
tokens_per_second, finish_reason}`. Streamed (server-sent events), each new piece of text is
`data: {"text": piece, "tokens_generated": so_far}`; the last event has `done: true`, the whole text
and the final counts; then `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator

from fastapi import Request
from starlette.responses import Response

from llmserve.entrypoints.openai.protocol import GenerateChunk, GenerateRequest, GenerateResponse
from llmserve.entrypoints.openai.serving import (
    SSE_DONE,
    EngineRequests,
    ServerContext,
    SSEResponse,
    json_response,
    sse_error,
    sse_event,
    until_disconnected,
)


class GenerateHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, request: GenerateRequest, raw_request: Request) -> Response:
        ctx, start = self.ctx, time.monotonic()
        prompt_ids = ctx.encode_prompt(request.prompt)
        params = ctx.sampling_params(request, [len(prompt_ids)], default_max=None)
        release = ctx.admit(1)
        requests = EngineRequests(
            ctx.engine, ctx.new_request_id("gen"), [prompt_ids], params, 0, request.stream
        )
        if request.stream:
            return SSEResponse(self._stream(requests, start), on_close=release)
        try:
            return await until_disconnected(raw_request, self._complete(requests, start))
        finally:
            release()

    async def _complete(self, requests: EngineRequests, start: float) -> Response:
        (output,) = await requests.final()
        (completion,) = output.outputs
        tokens, seconds = len(completion.token_ids), time.monotonic() - start
        return json_response(
            GenerateResponse(
                text=completion.text,
                tokens_generated=tokens,
                latency_ms=1000.0 * seconds,
                tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                finish_reason=completion.finish_reason,
            )
        )

    async def _stream(self, requests: EngineRequests, start: float) -> AsyncGenerator[str, None]:
        pieces, tokens, finish = [], 0, None
        try:
            async with contextlib.aclosing(requests.outputs()) as outputs:
                async for _, output in outputs:
                    for completion in output.outputs:
                        tokens += len(completion.token_ids)
                        finish = completion.finish_reason or finish
                        if completion.text:
                            pieces.append(completion.text)
                            chunk = GenerateChunk(text=completion.text, tokens_generated=tokens)
                            yield sse_event(chunk.model_dump_json())
        except Exception as error:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(error)
            yield SSE_DONE
            return
        seconds = time.monotonic() - start
        final = GenerateChunk(
            text="".join(pieces),
            tokens_generated=tokens,
            done=True,
            latency_ms=1000.0 * seconds,
            tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
            finish_reason=finish,
        )
        yield sse_event(final.model_dump_json())
        yield SSE_DONE
