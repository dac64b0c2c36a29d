"""Perplexity of a long real text through the engine's own paged KV cache.

Compares KV formats (`--kv-cache-dtype`) and sliding windows with or without attention sinks on the
same text (the benchmark corpus: the Python language reference). The text is one sequence fed in
prefill chunks through the engine's ModelRunner and KVCacheManager, so quantization on write, blocks
freed by the window and the attention masks are exactly those serving uses; every position's
logits score the next token. A chunk's queries each see their own window (the mask is per query),
so the result equals token-by-token streaming.

    python -m llmserve.benchmarks.kv_cache_ppl --tokens 4096 --sliding-window 256 --attention-sinks 4
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.benchmarks.results import run_metadata, write_result
from llmserve.config import EngineArgs
from llmserve.core.kv_cache_manager import NULL_BLOCK
from llmserve.engine.llm_engine import LLMEngine
from llmserve.forward_context import set_forward_context
from llmserve.request import Request
from llmserve.sampling_params import SamplingParams
from llmserve.worker.request_state import CachedRequestState

PROG = "python -m llmserve.benchmarks.kv_cache_ppl"


@dataclass(frozen=True)
class KVPerplexity:
    tokens: int  # tokens predicted: all but the first
    nll: float  # mean negative log-likelihood, nats per token
    peak_blocks: int  # most KV blocks the sequence held at once (a window frees the rest)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def perplexity(engine: LLMEngine, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given everything before each."""
    return score(engine, token_ids, chunk).perplexity


@torch.inference_mode()
def score(engine: LLMEngine, token_ids: list[int], chunk: int = 256) -> KVPerplexity:
    """Feed token_ids as one sequence in prefill chunks; score every next token."""
    runner, kv = engine.model_runner, engine.kv_cache_manager
    request = Request("ppl", token_ids, SamplingParams(max_tokens=1))
    total, peak = 0.0, 0
    try:
        for start in range(0, len(token_ids) - 1, chunk):
            count = min(chunk, len(token_ids) - 1 - start)  # predicts tokens start+1 .. start+count
            if not kv.allocate_slots(request, count):
                raise ValueError("the KV pool cannot hold one chunk and its context; raise kv_cache_memory")
            table = kv.get_block_table("ppl")
            peak = max(peak, sum(block != NULL_BLOCK for block in table))
            row = CachedRequestState(
                "ppl", token_ids, token_ids, request.sampling_params, (), None, table, start
            )
            inputs = runner.input_builder.build([(row, count)])
            with set_forward_context(inputs.attention):
                hidden = runner.model(inputs.input_ids, inputs.positions)
            logits = runner.model.compute_logits(hidden)
            targets = torch.tensor(token_ids[start + 1 : start + count + 1], device=logits.device)
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            request.num_computed_tokens += count
    finally:
        kv.free(request)
    return KVPerplexity(len(token_ids) - 1, total / (len(token_ids) - 1), peak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--attention-sinks", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=4096, help="text tokens scored")
    parser.add_argument("--skip", type=int, default=0, help="corpus tokens skipped first")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per prefill step")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="512MiB", help="KV pool size (its tokens are reported)")
    parser.add_argument(
        "--output", default=None, help="also write a JSON result (machine, command, date, commit, figures)"
    )
    args = parser.parse_args(argv)
    try:
        engine, result = _measure(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    cache = engine.config.cache
    print(
        f"ppl {result.perplexity:.4f}  tokens {args.tokens}  kv {cache.kv_cache_dtype}  "
        f"window {cache.sliding_window}  sinks {cache.attention_sinks}  "
        f"pool tokens {cache.num_blocks * cache.block_size}  peak blocks {result.peak_blocks}"
    )
    if args.output:
        command = shlex.join([*PROG.split(), *(sys.argv[1:] if argv is None else argv)])
        print(f"result: {_save(args.output, command, engine, result, args)}")
    return 0


def _measure(args: argparse.Namespace) -> tuple[LLMEngine, KVPerplexity]:
    if args.tokens < 2 or args.chunk < 1 or args.skip < 0:
        raise ValueError("--tokens must be >= 2, --chunk >= 1, --skip >= 0")
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            sliding_window=args.sliding_window,
            attention_sinks=args.attention_sinks,
            max_model_len=args.max_model_len or args.tokens + 1,
            kv_cache_memory=args.kv_cache_memory,
        )
    )
    from llmserve.corpus import corpus_text

    ids = engine.tokenizer.encode(corpus_text()[: 6 * (args.skip + args.tokens)])[args.skip :]
    if len(ids) < args.tokens:
        raise ValueError(f"the corpus gives only {len(ids)} tokens")
    return engine, score(engine, ids[: args.tokens], args.chunk)


def _save(path: str, command: str, engine: LLMEngine, result: KVPerplexity, args: argparse.Namespace):
    """The result file: `llmserve bench`'s run metadata, the settings, and the figures."""
    model, cache = engine.config.model, engine.config.cache
    payload = {
        **run_metadata("kv-cache-ppl", model.device),
        "command": command,  # run_metadata assumes the `llmserve` entry point
        "model": str(model.path),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": cache.kv_cache_dtype,
        "sliding_window": cache.sliding_window,
        "attention_sinks": cache.attention_sinks,
        "kv_cache_memory": args.kv_cache_memory,
        "block_size": cache.block_size,
        "pool_tokens": cache.num_blocks * cache.block_size,
        "skip": args.skip,
        "chunk": args.chunk,
        "tokens": args.tokens,
        "tokens_scored": result.tokens,
        "nll": result.nll,
        "perplexity": result.perplexity,
        "peak_blocks": result.peak_blocks,
    }
    return write_result(path, payload)


if __name__ == "__main__":
    sys.exit(main())
