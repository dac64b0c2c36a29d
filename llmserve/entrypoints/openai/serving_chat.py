"""POST /v1/chat/completions: messages rendered with the model's chat template, plain or streamed.

A stream opens with one role chunk per choice, then one chunk per new piece of text, and ends each
choice with a chunk carrying its finish_reason (exactly once), as OpenAI's clients expect. With tools
or a reasoning parser, each choice's text goes through its OutputParser (chat_tools.py): reasoning,
content and tool-call pieces, fed per delta when streamed and at once when not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any

import jinja2
from fastapi import Request
from starlette.responses import Response

from llmserve.engine.async_llm import EngineDeadError
from llmserve.entrypoints.openai.chat_tools import (
    OutputParser,
    ToolSpec,
    enforced_grammar,
    finish_reason,
    resolve_tools,
)
from llmserve.entrypoints.openai.prompt_logprobs import prompt_tokens, vllm_prompt_logprobs
from llmserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatToolCall,
    ChatTopLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    UsageInfo,
)
from llmserve.entrypoints.openai.serving import (
    SSE_DONE,
    ApiError,
    ChoiceProgress,
    Delta,
    EngineRequests,
    ServerContext,
    SSEResponse,
    TokenText,
    finite,
    json_response,
    sse_error,
    sse_event,
    top_entries,
    until_disconnected,
)
from llmserve.entrypoints.openai.structured_outputs import check_structured_outputs
from llmserve.entrypoints.openai.tool_parsers import ToolCallDelta
from llmserve.entrypoints.openai.tool_prompt import (
    rewrite_for_plain_template,
    template_reads_tools,
    tools_prompt,
)
from llmserve.sampling_params import SamplingParams


class ChatHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_text = TokenText(ctx.engine.tokenizer)

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        spec = resolve_tools(request.tool_dicts(), request.tool_choice_value(), request.parallel_tool_calls)
        prompt_text = self.render_text(
            request.template_messages(), request.add_generation_prompt, spec, request.chat_template_kwargs
        )
        prompt_ids = ctx.encode_prompt(self.encode(prompt_text), param="messages")
        params = ctx.sampling_params(request, [len(prompt_ids)], default_max=None)
        params = await self.with_tool_grammar(params, spec, request.structured_outputs_field())
        await check_structured_outputs(ctx, request, params)
        parsers = self._parsers(spec, prompt_text, request.n)
        release = ctx.admit(1, [len(prompt_ids)], request.timeout, params.max_tokens)
        requests = EngineRequests(
            ctx.engine,
            ctx.new_request_id("chatcmpl"),
            [prompt_ids],
            params,
            request.priority,
            request.stream,
            request.timeout,
        )
        if request.stream:
            return SSEResponse(self._stream(request, requests, parsers), on_close=release)
        try:
            return await until_disconnected(raw_request, self._complete(request, requests, parsers))
        finally:
            release()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation; a template that rejects it (say, bad role order) is a 400."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        try:  # the template writes any BOS itself
            return self.ctx.engine.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as error:
            raise ApiError(str(error), param="messages") from error

    def render_text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        spec: ToolSpec | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text: tools and tool turns rendered by the template when it reads `tools`, else
        written into the conversation in the parser's format (tool_prompt.py)."""
        options = self.ctx.chat_options
        tokenizer = self.ctx.engine.tokenizer
        tools = None if spec is None else list(spec.tools)
        template = tokenizer.chat_template_text(options.chat_template, tools=tools is not None)
        tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if template is not None and not template_reads_tools(template) and (tools or tool_turns):
            prompt = (
                None
                if spec is None
                else tools_prompt(tools, options.tool_call_parser, spec.hint, spec.parallel)
            )
            messages, tools = rewrite_for_plain_template(messages, options.tool_call_parser, prompt), None
        _check_template_kwargs(template_kwargs)
        try:
            return tokenizer.render_chat(
                messages, add_generation_prompt, tools, options.chat_template, template_kwargs
            )
        except (ValueError, jinja2.TemplateError) as error:
            raise ApiError(f"cannot render the messages: {error}", param="messages") from error

    async def with_tool_grammar(
        self, params: SamplingParams, spec: ToolSpec | None, structured_field: str | None
    ) -> SamplingParams:
        """`params` constrained to the calls that tool_choice required or named asks for."""
        if spec is not None and spec.enforced and structured_field not in (None, "tool_choice"):
            raise ApiError(
                f"tool_choice {spec.choice} cannot be combined with {structured_field}: the output "
                "must be the tool calls",
                param="tool_choice",
            )
        timeout = self.ctx.engine.config.structured_outputs.compile_timeout
        grammar = await enforced_grammar(spec, self.ctx.chat_options.tool_call_parser, timeout)
        return params if grammar is None else replace(params, structured_outputs=grammar)

    def _parsers(self, spec: ToolSpec | None, prompt_text: str, n: int) -> list[OutputParser] | None:
        """One output parser per choice, or None when the text is passed through as it is."""
        if spec is None and self.ctx.chat_options.reasoning_parser is None:
            return None
        return [OutputParser(spec, self.ctx.chat_options, prompt_text) for _ in range(n)]

    async def _complete(
        self, request: ChatCompletionRequest, requests: EngineRequests, parsers: list[OutputParser] | None
    ) -> Response:
        (output,) = await requests.final()
        choices = []
        for completion in output.outputs:
            delta = ChoiceProgress().advance(completion, with_logprobs=request.logprobs)
            message, finish = ChatResponseMessage(content=delta.text), delta.finish_reason
            if parsers is not None:
                message, finish = _parsed_message(parsers[completion.index], delta.text, finish)
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self._logprobs(request, delta),
                    finish_reason=finish,
                )
            )
        prompt_logprobs = None
        if request.prompt_logprobs is not None:  # vLLM's field (never with stream)
            tokens = prompt_tokens(output.prompt_token_ids, output.prompt_logprobs)
            prompt_logprobs = vllm_prompt_logprobs(tokens, request.prompt_logprobs, self.token_text)
        return json_response(
            ChatCompletionResponse(
                id=requests.id,
                model=self.ctx.model_name(request.model),
                choices=choices,
                usage=requests.usage(),
                prompt_logprobs=prompt_logprobs,
            )
        )

    async def _stream(
        self, request: ChatCompletionRequest, requests: EngineRequests, parsers: list[OutputParser] | None
    ) -> AsyncGenerator[str, None]:
        progress = [ChoiceProgress() for _ in range(request.n)]
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(
                id=requests.id,
                created=created,
                model=self.ctx.model_name(request.model),
                choices=choices,
                usage=usage,
            )
            return sse_event(body.model_dump_json())

        for index in range(request.n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        try:
            async with contextlib.aclosing(requests.outputs()) as outputs:
                async for _, output in outputs:
                    for completion in output.outputs:
                        delta = progress[completion.index].advance(completion, request.logprobs)
                        if delta is None:
                            continue
                        parser = None if parsers is None else parsers[completion.index]
                        choice = self._stream_choice(request, completion.index, delta, parser)
                        if choice is not None:
                            yield chunk([choice])
        except EngineDeadError:
            for index, choice in enumerate(progress):  # shutting down: end every open choice
                if not choice.finished:
                    yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(), finish_reason="abort")])
        except Exception as error:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(error)
            yield SSE_DONE
            return
        if request.include_usage:
            yield chunk([], usage=requests.usage())
        yield SSE_DONE

    def _stream_choice(
        self, request: ChatCompletionRequest, index: int, delta: Delta, parser: OutputParser | None
    ) -> ChatStreamChoice | None:
        """The chunk for a choice's delta; None when its parser holds all of the text back."""
        message, finish = DeltaMessage(content=delta.text or None), delta.finish_reason
        if parser is not None:
            message, finish = _parsed_delta(parser, delta.text, finish)
            if message is None and finish is None and delta.logprobs is None:
                return None
        return ChatStreamChoice(
            index=index,
            delta=message or DeltaMessage(),
            logprobs=self._logprobs(request, delta),
            finish_reason=finish,
        )

    def _logprobs(self, request: ChatCompletionRequest, delta: Delta) -> ChatChoiceLogprobs | None:
        if not request.logprobs or delta.logprobs is None:
            return None
        return ChatChoiceLogprobs(
            content=self._token_logprobs(delta.token_ids, delta.logprobs, request.top_logprobs or 0)
        )

    def _token_logprobs(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, float]], top_n: int
    ) -> list[ChatTokenLogprob]:
        """Per token: its text, bytes and logprob, and the `top_n` most likely alternatives."""
        return [
            ChatTokenLogprob(
                **self._top(token_id, entry.get(token_id, float("-inf"))).model_dump(),
                top_logprobs=[self._top(t, lp) for t, lp in top_entries(entry, top_n)],
            )
            for token_id, entry in zip(token_ids, entries, strict=False)
        ]

    def _top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        token = self.token_text(token_id)
        return ChatTopLogprob(token=token, logprob=finite(logprob), bytes=self.token_text.bytes_of(token_id))


def _parsed_message(
    parser: OutputParser, text: str, finish: str | None
) -> tuple[ChatResponseMessage, str | None]:
    parsed = parser.parse(text)
    calls = [
        ChatToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in parsed.tool_calls
    ]
    message = ChatResponseMessage(
        content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls or None
    )
    return message, finish_reason(finish, bool(calls))


def _parsed_delta(
    parser: OutputParser, text: str, finish: str | None
) -> tuple[DeltaMessage | None, str | None]:
    """The delta's reasoning, content and call pieces (the parser flushed when the choice finished)."""
    piece = parser.step(text, finish is not None)
    calls = [_delta_call(call) for call in piece.parsed.tool_calls]
    reasoning, content = piece.reasoning or None, piece.parsed.content or None
    message = DeltaMessage(reasoning=reasoning, content=content, tool_calls=calls or None)
    empty = reasoning is None and content is None and not calls
    return (None if empty else message), finish_reason(finish, parser.called)


def _delta_call(call: ToolCallDelta) -> DeltaToolCall:
    if call.id is not None:  # a call's header: its id and name, before any of its arguments
        function = DeltaFunctionCall(name=call.name, arguments="")
        return DeltaToolCall(index=call.index, id=call.id, type="function", function=function)
    return DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """chat_template_kwargs may set template variables, not the renderer's own arguments."""
    reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ApiError(
            f"chat_template_kwargs: {', '.join(reserved)} cannot be set there (the request's own fields "
            "decide it)",
            param="chat_template_kwargs",
        )


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
