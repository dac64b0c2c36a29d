"""POST /v1/responses, stateless: OpenAI's Responses API over the chat path (one message out).

The input (text, or messages) follows the instructions as a system message and is rendered with the
chat template, as /v1/chat/completions does. Nothing is stored, so `store: true` and
`previous_response_id` are 400s. A stream is OpenAI's typed events, each `event: <type>` plus its
JSON with a growing `sequence_number`: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta per piece of
text, response.output_text.done, response.content_part.done, response.output_item.done, and finally
response.completed (or response.incomplete when max_output_tokens cut it).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from llmserve.entrypoints.openai.protocol import (
    STORED_RESPONSES,
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponseUsage,
)
from llmserve.entrypoints.openai.serving import (
    ApiError,
    EngineRequests,
    ServerContext,
    SSEResponse,
    json_response,
    sse_error,
    until_disconnected,
)
from llmserve.entrypoints.openai.serving_chat import ChatHandler
from llmserve.entrypoints.openai.structured_outputs import check_structured_outputs


class ResponsesHandler:
    def __init__(self, ctx: ServerContext, chat: ChatHandler) -> None:
        self.ctx = ctx
        self.chat = chat  # renders the conversation with the chat template

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        _check_supported(request)
        prompt_ids = ctx.encode_prompt(self.chat.render(request.template_messages()), param="input")
        params = ctx.sampling_params(request, [len(prompt_ids)], default_max=None)
        await check_structured_outputs(ctx, request, params)
        release = ctx.admit(1)
        requests = EngineRequests(
            ctx.engine, f"resp_{uuid.uuid4().hex}", [prompt_ids], params, 0, request.stream
        )
        if request.stream:
            return SSEResponse(self._stream(request, requests), on_close=release)
        try:
            return await until_disconnected(raw_request, self._complete(request, requests))
        finally:
            release()

    def _response(self, request: ResponsesRequest, requests: EngineRequests, **fields: Any) -> ResponseObject:
        return ResponseObject(
            id=requests.id,
            model=self.ctx.served_model_name,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            metadata=request.metadata or {},
            **fields,
        )

    def _finished(
        self,
        request: ResponsesRequest,
        requests: EngineRequests,
        message_id: str,
        text: str,
        finish: str | None,
    ) -> ResponseObject:
        complete = finish != "length"
        status = "completed" if complete else "incomplete"
        message = ResponseOutputMessage(id=message_id, status=status, content=[ResponseOutputText(text=text)])
        return self._response(
            request,
            requests,
            status=status,
            incomplete_details=None if complete else {"reason": "max_output_tokens"},
            output=[message],
            usage=ResponseUsage.of(requests.usage()),
        )

    async def _complete(self, request: ResponsesRequest, requests: EngineRequests) -> Response:
        (output,) = await requests.final()
        (completion,) = output.outputs
        message_id = f"msg_{uuid.uuid4().hex}"
        return json_response(
            self._finished(request, requests, message_id, completion.text, completion.finish_reason)
        )

    async def _stream(self, request: ResponsesRequest, requests: EngineRequests) -> AsyncGenerator[str, None]:
        events = _Events()
        message_id = f"msg_{uuid.uuid4().hex}"
        item = {"output_index": 0, "item_id": message_id, "content_index": 0}
        in_progress = self._response(request, requests, status="in_progress").model_dump(mode="json")
        yield events.send("response.created", response=in_progress)
        yield events.send("response.in_progress", response=in_progress)
        empty = ResponseOutputMessage(id=message_id, status="in_progress", content=[])
        yield events.send("response.output_item.added", output_index=0, item=empty.model_dump(mode="json"))
        part = ResponseOutputText(text="").model_dump(mode="json")
        yield events.send("response.content_part.added", **item, part=part)
        pieces, finish = [], None
        try:
            async with contextlib.aclosing(requests.outputs()) as outputs:
                async for _, output in outputs:
                    for completion in output.outputs:
                        finish = completion.finish_reason or finish
                        if completion.text:
                            pieces.append(completion.text)
                            yield events.send(
                                "response.output_text.delta", **item, delta=completion.text, logprobs=[]
                            )
        except Exception as error:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(error)
            return
        text = "".join(pieces)
        final = self._finished(request, requests, message_id, text, finish)
        yield events.send("response.output_text.done", **item, text=text, logprobs=[])
        done_part = ResponseOutputText(text=text).model_dump(mode="json")
        yield events.send("response.content_part.done", **item, part=done_part)
        message = final.output[0].model_dump(mode="json")
        yield events.send("response.output_item.done", output_index=0, item=message)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield events.send(kind, response=final.model_dump(mode="json"))


class _Events:
    """Typed server-sent events with OpenAI's growing sequence number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def _check_supported(request: ResponsesRequest) -> None:
    """What this stateless server cannot do yet is a 400 naming the field, never silently ignored."""
    if request.previous_response_id is not None:
        raise ApiError(STORED_RESPONSES, param="previous_response_id")
    if request.store:
        raise ApiError(f"store: true is not supported: {STORED_RESPONSES}", param="store")
    if request.tools:
        raise ApiError("tools are not supported on /v1/responses yet", param="tools")
