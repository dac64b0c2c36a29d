"""The engine's prompt logprobs as the API reports them: vLLM's `prompt_logprobs` list and the prompt's
part of a completion's `logprobs` under `echo`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmserve.entrypoints.openai.protocol import PromptLogprob, PromptLogprobList
from llmserve.entrypoints.openai.serving import finite
from llmserve.outputs import PromptLogprobs

# per prompt token: (token id, None for the first token, else [(token id, logprob, rank)] best first
# with the token itself included)
PromptTokens = list[tuple[int, list[tuple[int, float, int]] | None]]


def prompt_tokens(prompt_token_ids: Sequence[int], logprobs: PromptLogprobs | None) -> PromptTokens:
    """Each prompt token with its alternatives from the engine's rows (row p is about token p + 1)."""
    tokens: PromptTokens = [(prompt_token_ids[0], None)]
    rows = logprobs if logprobs is not None and logprobs.first_position == 0 else None
    for position, token_id in enumerate(prompt_token_ids[1:]):
        if rows is None or position >= len(rows.token_logprobs):
            tokens.append((token_id, None))
            continue
        pairs = zip(rows.top_token_ids[position], rows.top_logprobs[position], strict=True)
        top = [(t, lp, rank + 1) for rank, (t, lp) in enumerate(pairs)]
        if token_id not in rows.top_token_ids[position]:
            top.append((token_id, rows.token_logprobs[position], rows.token_ranks[position]))
        tokens.append((token_id, top))
    return tokens


def token_logprob(token_id: int, top: list[tuple[int, float, int]]) -> float:
    return finite(next(lp for t, lp, _ in top if t == token_id))


def within(top: list[tuple[int, float, int]], token_id: int, top_n: int) -> list[tuple[int, float, int]]:
    """The `top_n` best alternatives, and the token itself wherever it ranks."""
    return [(t, lp, rank) for t, lp, rank in top if rank <= top_n or t == token_id]


def vllm_prompt_logprobs(
    tokens: PromptTokens, top_n: int, token_text: Callable[[int], str]
) -> PromptLogprobList:
    """vLLM's shape: per prompt token None (the first) or token id -> {logprob, rank, decoded_token}."""
    return [
        None
        if top is None
        else {
            str(t): PromptLogprob(logprob=finite(lp), rank=rank, decoded_token=token_text(t))
            for t, lp, rank in within(top, token_id, top_n)
        }
        for token_id, top in tokens
    ]
