"""POST /v1/completions: text (or token-id) prompts, plain or streamed, n choices per prompt.

A list of prompts becomes one engine request per prompt; choice `i * n + j` is sample j of prompt i.
With `best_of` the engine samples best_of candidates per prompt and the n with the highest
cumulative logprob are returned (as vLLM and OpenAI do); `echo` with `logprobs` reports the prompt's
tokens from the engine's prompt logprobs; `suffix` makes a fill-in-the-middle prompt (fim.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Sequence

from fastapi import Request
from starlette.responses import Response

from llmserve.engine.async_llm import EngineDeadError
from llmserve.entrypoints.openai.fim import fim_prompt, fim_token_ids
from llmserve.entrypoints.openai.prompt_logprobs import (
    PromptTokens,
    prompt_tokens,
    token_logprob,
    vllm_prompt_logprobs,
    within,
)
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
from llmserve.outputs import CompletionOutput, RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


class CompletionHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.token_text = TokenText(ctx.engine.tokenizer)
        self._fim_tokens: tuple[int, int, int] | None | bool = False  # False: not looked up yet

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        prompts = request.prompts()
        if request.suffix:
            prompt_ids = [self._fim_prompt(prompt, request.suffix) for prompt in prompts]
        else:
            prompt_ids = [ctx.encode_prompt(prompt) for prompt in prompts]
        params = ctx.sampling_params(request, [len(ids) for ids in prompt_ids], DEFAULT_MAX_TOKENS)
        await check_structured_outputs(ctx, request, params)
        echoes = [
            self._echo_text(p, ids) if request.echo else ""
            for p, ids in zip(prompts, prompt_ids, strict=True)
        ]
        release = ctx.admit(
            len(prompts), [len(ids) for ids in prompt_ids], request.timeout, params.max_tokens
        )
        requests = EngineRequests(
            ctx.engine,
            ctx.new_request_id("cmpl"),
            prompt_ids,
            params,
            request.priority,
            request.stream,
            request.timeout,
        )
        if request.stream:
            return SSEResponse(self._stream(request, requests, echoes), on_close=release)
        try:
            return await until_disconnected(raw_request, self._complete(request, requests, echoes))
        finally:
            release()

    def _fim_prompt(self, prompt: str | list[int], suffix: str) -> list[int]:
        """The fill-in-the-middle prompt; a 400 for a model without fill-in-the-middle tokens."""
        if self._fim_tokens is False:
            self._fim_tokens = fim_token_ids(self.ctx.engine.tokenizer.hf.get_vocab())
        if self._fim_tokens is None:
            raise ApiError(
                "suffix is not supported by this model: its tokenizer has no fill-in-the-middle tokens",
                param="suffix",
            )
        tokenizer = self.ctx.engine.tokenizer
        prefix_ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        ids = fim_prompt(self._fim_tokens, prefix_ids, tokenizer.encode(suffix, add_special_tokens=False))
        return self.ctx.encode_prompt(ids)

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
            prompt = self._prompt_tokens(request, output)
            for rank, completion in enumerate(self._best(request, output.outputs)):
                delta = ChoiceProgress().advance(completion, with_logprobs=request.logprobs is not None)
                choice = self._choice(
                    request, prompt_index * request.n + rank, delta, echoes[prompt_index], prompt
                )
                choices.append(choice)
        response = CompletionResponse(
            id=requests.id, model=self.ctx.model_name(request.model), choices=choices, usage=requests.usage()
        )
        return json_response(response)

    async def _stream(
        self, request: CompletionRequest, requests: EngineRequests, echoes: list[str]
    ) -> AsyncGenerator[str, None]:
        n, with_logprobs = request.n, request.logprobs is not None
        progress = [ChoiceProgress() for _ in range(len(echoes) * n)]
        offsets = [0] * len(progress)
        echoed: set[int] = set()
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            body = CompletionResponse(
                id=requests.id,
                created=created,
                model=self.ctx.model_name(request.model),
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
                        first = index not in echoed
                        echo = echoes[prompt_index] if first else ""
                        prompt = self._prompt_tokens(request, output) if first else None
                        echoed.add(index)
                        yield chunk([self._choice(request, index, delta, echo, prompt, offsets[index])])
                        if with_logprobs:  # text offsets are reported in logprobs only
                            offsets[index] += len(echo) + sum(
                                len(self.token_text(t)) for t in delta.token_ids
                            )
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

    @staticmethod
    def _best(request: CompletionRequest, candidates: list[CompletionOutput]) -> list[CompletionOutput]:
        """The n completions to return: with best_of, the likeliest by cumulative logprob."""
        if not request.ranks_candidates:
            return candidates
        ranked = sorted(candidates, key=lambda c: c.cumulative_logprob or float("-inf"), reverse=True)
        return ranked[: request.n]

    @staticmethod
    def _prompt_tokens(request: CompletionRequest, output: RequestOutput) -> PromptTokens | None:
        """The prompt's tokens with their logprob alternatives, when asked (echo with logprobs too)."""
        if request.requested_prompt_logprobs() is None:
            return None
        return prompt_tokens(output.prompt_token_ids, output.prompt_logprobs)

    def _choice(
        self,
        request: CompletionRequest,
        index: int,
        delta: Delta,
        echo: str,
        prompt: PromptTokens | None,
        offset: int = 0,
    ) -> CompletionChoice:
        logprobs = None
        if request.logprobs is not None and delta.logprobs is not None:
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, offset + len(echo))
            if echo and prompt is not None:  # echo with logprobs: the prompt's tokens come first
                logprobs = _joined(self._echo_logprobs(prompt, request.logprobs, offset), logprobs)
        vllm_prompt = None
        if request.prompt_logprobs is not None and prompt is not None:
            vllm_prompt = vllm_prompt_logprobs(prompt, request.prompt_logprobs, self.token_text)
        return CompletionChoice(
            index=index,
            text=echo + delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            prompt_logprobs=vllm_prompt,
        )

    def _echo_logprobs(self, prompt: PromptTokens, top_n: int, offset: int) -> CompletionLogprobs:
        """The prompt's tokens in the legacy shape; the first has no logprob (nothing precedes it)."""
        result = CompletionLogprobs()
        for token_id, top in prompt:
            token = self.token_text(token_id)
            result.tokens.append(token)
            result.text_offset.append(offset)
            if top is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(token_logprob(token_id, top))
                kept = within(top, token_id, top_n)
                result.top_logprobs.append({self.token_text(t): finite(lp) for t, lp, _ in kept})
            offset += len(token)
        return result

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


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )
