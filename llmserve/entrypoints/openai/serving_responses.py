"""POST /v1/responses, stateless: OpenAI's Responses API over the chat path (one message out).

The input (text, or messages) follows the instructions as a system message and is rendered with the
chat template, as /v1/chat/completions does. Nothing is stored, so `store: true` and
`previous_response_id` are 400s. A stream is OpenAI's typed events, each `event: <type>` plus its
JSON with a growing `sequence_number`: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta per piece of
text, response.output_text.done, response.content_part.done, response.output_item.done, and finally
response.completed (or response.incomplete when max_output_tokens cut it).

With tools, each call the model makes is a `function_call` output item (its `call_id` is what a
`function_call_output` input item answers), streamed as response.output_item.added, one
response.function_call_arguments.delta per piece of its arguments, response.function_call_arguments.done
and response.output_item.done; the text around calls is the message item, added when its first piece
comes.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from fastapi import Request
from starlette.responses import Response

from llmserve.entrypoints.openai.chat_tools import OutputParser, resolve_tools
from llmserve.entrypoints.openai.protocol import (
    STORED_RESPONSES,
    ResponseFunctionCall,
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
from llmserve.entrypoints.openai.tool_parsers import ParsedDelta


class ResponsesHandler:
    def __init__(self, ctx: ServerContext, chat: ChatHandler) -> None:
        self.ctx = ctx
        self.chat = chat  # renders the conversation with the chat template

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        _check_supported(request)
        spec = resolve_tools(request.tool_dicts(), request.tool_choice_value(), request.parallel_tool_calls)
        prompt_text = self.chat.render_text(request.template_messages(), True, spec)
        prompt_ids = ctx.encode_prompt(self.chat.encode(prompt_text), param="input")
        params = ctx.sampling_params(request, [len(prompt_ids)], default_max=None)
        params = await self.chat.with_tool_grammar(params, spec, request.structured_outputs_field())
        await check_structured_outputs(ctx, request, params)
        parser = (
            None if spec is None else OutputParser(spec, replace(ctx.chat_options, reasoning_parser=None), "")
        )
        release = ctx.admit(1)
        requests = EngineRequests(
            ctx.engine, f"resp_{uuid.uuid4().hex}", [prompt_ids], params, 0, request.stream
        )
        if request.stream:
            stream = (
                self._stream(request, requests)
                if parser is None
                else self._stream_tools(request, requests, parser)
            )
            return SSEResponse(stream, on_close=release)
        try:
            return await until_disconnected(raw_request, self._complete(request, requests, parser))
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
            tools=request.tool_dicts_flat(),
            tool_choice=_echoed_choice(request),
            parallel_tool_calls=request.parallel_tool_calls,
            **fields,
        )

    def _finished(
        self,
        request: ResponsesRequest,
        requests: EngineRequests,
        message_id: str,
        text: str,
        finish: str | None,
        calls: list[ResponseFunctionCall] | None = None,
    ) -> ResponseObject:
        complete = finish != "length"
        status = "completed" if complete else "incomplete"
        message = ResponseOutputMessage(id=message_id, status=status, content=[ResponseOutputText(text=text)])
        return self._response(
            request,
            requests,
            status=status,
            incomplete_details=None if complete else {"reason": "max_output_tokens"},
            output=[message, *(calls or [])] if text or not calls else list(calls),
            usage=ResponseUsage.of(requests.usage()),
        )

    async def _complete(
        self, request: ResponsesRequest, requests: EngineRequests, parser: OutputParser | None
    ) -> Response:
        (output,) = await requests.final()
        (completion,) = output.outputs
        message_id = f"msg_{uuid.uuid4().hex}"
        text, calls = completion.text, []
        if parser is not None:
            parsed = parser.parse(text)
            text = parsed.content or ""
            calls = [_function_call(call.id, call.name, call.arguments) for call in parsed.tool_calls]
        return json_response(
            self._finished(request, requests, message_id, text, completion.finish_reason, calls)
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

    async def _stream_tools(
        self, request: ResponsesRequest, requests: EngineRequests, parser: OutputParser
    ) -> AsyncGenerator[str, None]:
        """The events of a reply that may call tools: items are added as they start."""
        events = _Events()
        in_progress = self._response(request, requests, status="in_progress").model_dump(mode="json")
        yield events.send("response.created", response=in_progress)
        yield events.send("response.in_progress", response=in_progress)
        items = _StreamedItems(events)
        finish = None
        try:
            async with contextlib.aclosing(requests.outputs()) as outputs:
                async for _, output in outputs:
                    for completion in output.outputs:
                        finish = completion.finish_reason or finish
                        piece = parser.feed(completion.text) if completion.text else None
                        if finish is not None:
                            final = parser.finish()
                            piece = final if piece is None else piece
                            if piece is not final:
                                piece.parsed.add(final.parsed)
                        if piece is not None:
                            for event in items.add(piece.parsed):
                                yield event
        except Exception as error:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(error)
            return
        for event in items.close():
            yield event
        text = "".join(items.text)
        calls = [_function_call(c["call_id"], c["name"], c["arguments"], c["id"]) for c in items.calls]
        final_response = self._finished(request, requests, items.message_id, text, finish, calls)
        final_response.output = [*items.ordered(final_response.output)]
        kind = "response.completed" if final_response.status == "completed" else "response.incomplete"
        yield events.send(kind, response=final_response.model_dump(mode="json"))


class _StreamedItems:
    """The output items of a streamed reply with tools, in the order they started."""

    def __init__(self, events: _Events) -> None:
        self.events = events
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.message_index: int | None = None
        self.text: list[str] = []
        self.calls: list[dict[str, Any]] = []  # per call: its item fields and output index
        self.order: list[str] = []  # item ids by output index

    def add(self, parsed: ParsedDelta) -> list[str]:
        out = []
        if parsed.content:
            if self.message_index is None:
                out += self._open_message()
            self.text.append(parsed.content)
            item = {"output_index": self.message_index, "item_id": self.message_id, "content_index": 0}
            out.append(
                self.events.send("response.output_text.delta", **item, delta=parsed.content, logprobs=[])
            )
        for delta in parsed.tool_calls:
            if delta.id is not None:
                call = {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": delta.id,
                    "name": delta.name,
                    "arguments": "",
                }
                call["output_index"] = len(self.order)
                self.order.append(call["id"])
                self.calls.append(call)
                item = _function_call(delta.id, delta.name or "", "", call["id"], "in_progress")
                out.append(
                    self.events.send(
                        "response.output_item.added",
                        output_index=call["output_index"],
                        item=item.model_dump(mode="json"),
                    )
                )
            call = self.calls[delta.index]
            if delta.arguments:
                call["arguments"] += delta.arguments
                out.append(
                    self.events.send(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=call["output_index"],
                        delta=delta.arguments,
                    )
                )
        return out

    def _open_message(self) -> list[str]:
        self.message_index = len(self.order)
        self.order.append(self.message_id)
        empty = ResponseOutputMessage(id=self.message_id, status="in_progress", content=[])
        item = {"output_index": self.message_index, "item_id": self.message_id, "content_index": 0}
        part = ResponseOutputText(text="").model_dump(mode="json")
        return [
            self.events.send(
                "response.output_item.added",
                output_index=self.message_index,
                item=empty.model_dump(mode="json"),
            ),
            self.events.send("response.content_part.added", **item, part=part),
        ]

    def close(self) -> list[str]:
        """The done events of every item; a reply with neither text nor calls gets an empty message."""
        out = self._open_message() if self.message_index is None and not self.calls else []
        if self.message_index is not None:
            text = "".join(self.text)
            item = {"output_index": self.message_index, "item_id": self.message_id, "content_index": 0}
            out.append(self.events.send("response.output_text.done", **item, text=text, logprobs=[]))
            part = ResponseOutputText(text=text).model_dump(mode="json")
            out.append(self.events.send("response.content_part.done", **item, part=part))
            message = ResponseOutputMessage(id=self.message_id, status="completed", content=[part])
            out.append(
                self.events.send(
                    "response.output_item.done",
                    output_index=self.message_index,
                    item=message.model_dump(mode="json"),
                )
            )
        for call in self.calls:
            index = call["output_index"]
            out.append(
                self.events.send(
                    "response.function_call_arguments.done",
                    item_id=call["id"],
                    output_index=index,
                    name=call["name"],
                    arguments=call["arguments"],
                )
            )
            item = _function_call(call["call_id"], call["name"], call["arguments"], call["id"])
            out.append(
                self.events.send(
                    "response.output_item.done", output_index=index, item=item.model_dump(mode="json")
                )
            )
        return out

    def ordered(self, items: list) -> list:
        """`items` (the final response's output) in the order they were streamed."""
        by_id = {item.id: item for item in items}
        return [by_id[item_id] for item_id in self.order if item_id in by_id]


def _echoed_choice(request: ResponsesRequest) -> str | dict[str, str]:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _function_call(
    call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed"
) -> ResponseFunctionCall:
    return ResponseFunctionCall(
        id=item_id or f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name, arguments=arguments, status=status
    )


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
