"""POST /v1/chat/completions: messages rendered with the model's chat template, plain or streamed.

A stream opens with one role chunk per choice, then one chunk per new piece of text, and ends each
choice with a chunk carrying its finish_reason (exactly once), as OpenAI's clients expect.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Sequence

import jinja2
from fastapi import Request
from starlette.responses import Response

from llmserve.engine.async_llm import EngineDeadError
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
    ChatTopLogprob,
    DeltaMessage,
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


class ChatHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_text = TokenText(ctx.engine.tokenizer)

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        prompt_ids = ctx.encode_prompt(
            self.render(request.template_messages(), request.add_generation_prompt), param="messages"
        )
        params = ctx.sampling_params(request, [len(prompt_ids)], default_max=None)
        await check_structured_outputs(ctx, request, params)
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
            return SSEResponse(self._stream(request, requests), on_close=release)
        try:
            return await until_disconnected(raw_request, self._complete(request, requests))
        finally:
            release()

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation; a template that rejects it (say, bad role order) is a 400."""
        try:
            return list(
                self.ctx.engine.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt
                )
            )
        except (ValueError, jinja2.TemplateError) as error:
            raise ApiError(f"cannot render the messages: {error}", param="messages") from error

    async def _complete(self, request: ChatCompletionRequest, requests: EngineRequests) -> Response:
        (output,) = await requests.final()
        choices = []
        for completion in output.outputs:
            delta = ChoiceProgress().advance(completion, with_logprobs=request.logprobs)
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=ChatResponseMessage(content=delta.text),
                    logprobs=self._logprobs(request, delta),
                    finish_reason=delta.finish_reason,
                )
            )
        prompt_logprobs = None
        if request.prompt_logprobs is not None:  # vLLM's field (never with stream)
            tokens = prompt_tokens(output.prompt_token_ids, output.prompt_logprobs)
            prompt_logprobs = vllm_prompt_logprobs(tokens, request.prompt_logprobs, self.token_text)
        return json_response(
            ChatCompletionResponse(
                id=requests.id,
                model=self.ctx.served_model_name,
                choices=choices,
                usage=requests.usage(),
                prompt_logprobs=prompt_logprobs,
            )
        )

    async def _stream(
        self, request: ChatCompletionRequest, requests: EngineRequests
    ) -> AsyncGenerator[str, None]:
        progress = [ChoiceProgress() for _ in range(request.n)]
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(
                id=requests.id,
                created=created,
                model=self.ctx.served_model_name,
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
                        if delta is not None:
                            yield chunk([self._stream_choice(request, completion.index, delta)])
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

    def _stream_choice(self, request: ChatCompletionRequest, index: int, delta: Delta) -> ChatStreamChoice:
        return ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=delta.text or None),
            logprobs=self._logprobs(request, delta),
            finish_reason=delta.finish_reason,
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
