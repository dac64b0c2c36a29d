"""POST /v1/completions: text (or token-id) prompts, plain or streamed, n choices per prompt.

A list of prompts becomes one engine request per prompt; choice `i * n + j` is sample j of prompt i.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Sequence

from fastapi import Request
from starlette.responses import Response

from llmserve.engine.async_llm import EngineDeadError
from llmserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
    until_disconnected,
)
from llmserve.entrypoints.openai.structured_outputs import check_structured_outputs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


class CompletionHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_text = TokenText(ctx.engine.tokenizer)

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        if request.echo and request.logprobs is not None:
            raise ApiError(
                "echo with logprobs needs prompt logprobs, which this server does not compute", param="echo"
            )
        prompts = request.prompts()
        prompt_ids = [ctx.encode_prompt(prompt) for prompt in prompts]
        params = ctx.sampling_params(request, [len(ids) for ids in prompt_ids], DEFAULT_MAX_TOKENS)
        await check_structured_outputs(ctx, request, params)
        echoes = [
            self._echo_text(p, ids) if request.echo else ""
            for p, ids in zip(prompts, prompt_ids, strict=True)
        ]
        release = ctx.admit(len(prompts))
        requests = EngineRequests(
            ctx.engine, ctx.new_request_id("cmpl"), prompt_ids, params, request.priority, request.stream
        )
        if request.stream:
            return SSEResponse(self._stream(request, requests, echoes), on_close=release)
        try:
            return await until_disconnected(raw_request, self._complete(request, requests, echoes))
        finally:
            release()

    def _echo_text(self, prompt: str | list[int], prompt_ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.ctx.engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    async def _complete(
        self, request: CompletionRequest, requests: EngineRequests, echoes: list[str]
    ) -> Response:
        finals = await requests.final()
        choices = []
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                delta = ChoiceProgress().advance(completion, with_logprobs=request.logprobs is not None)
                choices.append(
                    self._choice(
                        request,
                        prompt_index * request.n + completion.index,
                        delta,
                        echoes[prompt_index],
                        offset=len(echoes[prompt_index]),
                    )
                )
        response = CompletionResponse(
            id=requests.id, model=self.ctx.served_model_name, choices=choices, usage=requests.usage()
        )
        return json_response(response)

    async def _stream(
        self, request: CompletionRequest, requests: EngineRequests, echoes: list[str]
    ) -> AsyncGenerator[str, None]:
        n, with_logprobs = request.n, request.logprobs is not None
        progress = [ChoiceProgress() for _ in range(len(echoes) * n)]
        offsets = [len(echoes[i // n]) for i in range(len(progress))]
        echoed: set[int] = set()
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            body = CompletionResponse(
                id=requests.id,
                created=created,
                model=self.ctx.served_model_name,
                choices=choices,
                usage=usage,
            )
            return sse_event(body.model_dump_json())

        try:
            async with contextlib.aclosing(requests.outputs()) as outputs:
                async for prompt_index, output in outputs:
                    for completion in output.outputs:
                        index = prompt_index * n + completion.index
                        delta = progress[index].advance(completion, with_logprobs)
                        if delta is None:
                            continue
                        echo = "" if index in echoed else echoes[prompt_index]
                        echoed.add(index)
                        yield chunk([self._choice(request, index, delta, echo, offsets[index])])
                        offsets[index] += len(echo) + sum(len(self.token_text(t)) for t in delta.token_ids)
        except EngineDeadError:
            for index, choice in enumerate(progress):  # shutting down: end every open choice
                if not choice.finished:
                    yield chunk([CompletionChoice(index=index, text="", finish_reason="abort")])
        except Exception as error:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(error)
            yield SSE_DONE
            return
        if request.include_usage:
            yield chunk([], usage=requests.usage())
        yield SSE_DONE

    def _choice(
        self, request: CompletionRequest, index: int, delta: Delta, echo: str, offset: int
    ) -> CompletionChoice:
        logprobs = None
        if request.logprobs is not None and delta.logprobs is not None:
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, offset)
        return CompletionChoice(
            index=index, text=echo + delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
        )

    def _logprobs(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, float]], offset: int
    ) -> CompletionLogprobs:
        """OpenAI's legacy shape: per token its text, offset, logprob and top-N (+ sampled) alternatives."""
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries, strict=False):
            token = self.token_text(token_id)
            result.tokens.append(token)
            result.text_offset.append(offset)
            result.token_logprobs.append(finite(entry.get(token_id, float("-inf"))))
            ranked = sorted(entry.items(), key=lambda item: item[1], reverse=True)
            result.top_logprobs.append({self.token_text(t): finite(lp) for t, lp in ranked})
            offset += len(token)
        return result
