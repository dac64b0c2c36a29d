"""POST /v1/responses, stateless: OpenAI's Responses API over the chat path (one message out).

The input (text, or messages) follows the instructions as a system message and is rendered with the
chat template, as /v1/chat/completions does. Nothing is stored, so `store: true` and
`previous_response_id` are 400s. A stream is OpenAI's typed events, each `event: <type>` plus its
JSON with a growing `sequence_number`: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta per piece of
text, response.output_text.done, response.content_part.done, response.output_item.done, and finally
response.completed (or response.incomplete when max_output_tokens cut it).

With tools or a reasoning parser the reply is split by an OutputParser (chat_tools.py) into a
`reasoning` item, the `message` and a `function_call` item per call (its `call_id` is what a
`function_call_output` input item answers), streamed as responses_items.py describes.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from llmserve.entrypoints.openai.chat_tools import OutputParser, resolve_tools
from llmserve.entrypoints.openai.protocol import (
    STORED_RESPONSES,
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponseUsage,
)
from llmserve.entrypoints.openai.reasoning_parsers import count_reasoning_tokens
from llmserve.entrypoints.openai.responses_items import Events, StreamedItems, function_call, reasoning_item
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
        spec = resolve_tools(request.tool_dicts(), request.tool_choice_value(), request.parallel_tool_calls)
        prompt_text = self.chat.render_text(request.template_messages(), True, spec)
        prompt_ids = ctx.encode_prompt(self.chat.encode(prompt_text), param="input")
        params = ctx.sampling_params(request, [len(prompt_ids)], default_max=None)
        params = await self.chat.with_tool_grammar(params, spec, request.structured_outputs_field())
        await check_structured_outputs(ctx, request, params)
        parser = None
        if spec is not None or ctx.chat_options.reasoning_parser is not None:
            parser = OutputParser(spec, ctx.chat_options, prompt_text)
        release = ctx.admit(1)
        requests = EngineRequests(
            ctx.engine, f"resp_{uuid.uuid4().hex}", [prompt_ids], params, 0, request.stream
        )
        skip_special = params.skip_special_tokens
        if request.stream:
            stream = (
                self._stream(request, requests)
                if parser is None
                else self._stream_parsed(request, requests, parser, skip_special)
            )
            return SSEResponse(stream, on_close=release)
        try:
            return await until_disconnected(
                raw_request, self._complete(request, requests, parser, skip_special)
            )
        finally:
            release()

    def _response(self, request: ResponsesRequest, requests: EngineRequests, **fields: Any) -> ResponseObject:
        return ResponseObject(
            id=requests.id,
            model=self.ctx.model_name(request.model),
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
        finish: str | None,
        output: list[Any],
        reasoning_tokens: int = 0,
    ) -> ResponseObject:
        complete = finish != "length"
        return self._response(
            request,
            requests,
            status="completed" if complete else "incomplete",
            incomplete_details=None if complete else {"reason": "max_output_tokens"},
            output=output,
            usage=ResponseUsage.of(requests.usage(), reasoning_tokens),
        )

    @staticmethod
    def _message(text: str, finish: str | None, message_id: str | None = None) -> ResponseOutputMessage:
        status = "completed" if finish != "length" else "incomplete"
        message_id = message_id or f"msg_{uuid.uuid4().hex}"
        return ResponseOutputMessage(id=message_id, status=status, content=[ResponseOutputText(text=text)])

    def _reasoning_tokens(self, token_ids: list[int], parser: OutputParser, skip_special: bool) -> int:
        def decode(ids: list[int]) -> str:
            return self.ctx.engine.tokenizer.decode(ids, skip_special_tokens=skip_special)

        return count_reasoning_tokens(token_ids, decode, parser.reasoning)

    async def _complete(
        self,
        request: ResponsesRequest,
        requests: EngineRequests,
        parser: OutputParser | None,
        skip_special: bool,
    ) -> Response:
        (output,) = await requests.final()
        (completion,) = output.outputs
        finish = completion.finish_reason
        if parser is None:
            return json_response(
                self._finished(request, requests, finish, [self._message(completion.text, finish)])
            )
        parsed = parser.parse(completion.text)
        items: list[Any] = [reasoning_item(parsed.reasoning)] if parsed.reasoning else []
        if parsed.content or not parsed.tool_calls:
            items.append(self._message(parsed.content or "", finish))
        items += [function_call(call.id, call.name, call.arguments) for call in parsed.tool_calls]
        reasoning_tokens = self._reasoning_tokens(list(completion.token_ids), parser, skip_special)
        return json_response(self._finished(request, requests, finish, items, reasoning_tokens))

    async def _stream(self, request: ResponsesRequest, requests: EngineRequests) -> AsyncGenerator[str, None]:
        events = Events()
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
        final = self._finished(request, requests, finish, [self._message(text, finish, message_id)])
        yield events.send("response.output_text.done", **item, text=text, logprobs=[])
        done_part = ResponseOutputText(text=text).model_dump(mode="json")
        yield events.send("response.content_part.done", **item, part=done_part)
        message = final.output[0].model_dump(mode="json")
        yield events.send("response.output_item.done", output_index=0, item=message)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield events.send(kind, response=final.model_dump(mode="json"))

    async def _stream_parsed(
        self, request: ResponsesRequest, requests: EngineRequests, parser: OutputParser, skip_special: bool
    ) -> AsyncGenerator[str, None]:
        """The events of a reply split into reasoning, text and calls: items are added as they start."""
        events = Events()
        in_progress = self._response(request, requests, status="in_progress").model_dump(mode="json")
        yield events.send("response.created", response=in_progress)
        yield events.send("response.in_progress", response=in_progress)
        items = StreamedItems(events)
        finish, token_ids = None, []
        try:
            async with contextlib.aclosing(requests.outputs()) as outputs:
                async for _, output in outputs:
                    for completion in output.outputs:
                        finish = completion.finish_reason or finish
                        token_ids += completion.token_ids
                        piece = parser.step(completion.text, completion.finish_reason is not None)
                        for event in items.add(piece):
                            yield event
        except Exception as error:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(error)
            return
        for event in items.close():
            yield event
        status = "completed" if finish != "length" else "incomplete"
        reasoning_tokens = self._reasoning_tokens(token_ids, parser, skip_special)
        final = self._finished(request, requests, finish, items.output(status), reasoning_tokens)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield events.send(kind, response=final.model_dump(mode="json"))


def _echoed_choice(request: ResponsesRequest) -> str | dict[str, str]:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _check_supported(request: ResponsesRequest) -> None:
    """What this stateless server cannot do yet is a 400 naming the field, never silently ignored."""
    if request.previous_response_id is not None:
        raise ApiError(STORED_RESPONSES, param="previous_response_id")
    if request.store:
        raise ApiError(f"store: true is not supported: {STORED_RESPONSES}", param="store")
