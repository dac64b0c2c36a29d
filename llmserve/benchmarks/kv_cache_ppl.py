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
import sys

import torch
import torch.nn.functional as F

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.forward_context import set_forward_context
from llmserve.request import Request
from llmserve.sampling_params import SamplingParams
from llmserve.worker.request_state import CachedRequestState


@torch.inference_mode()
def perplexity(engine: LLMEngine, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given everything before each."""
    runner, kv = engine.model_runner, engine.kv_cache_manager
    request = Request("ppl", token_ids, SamplingParams(max_tokens=1))
    total = 0.0
    try:
        for start in range(0, len(token_ids) - 1, chunk):
            count = min(chunk, len(token_ids) - 1 - start)  # predicts tokens start+1 .. start+count
            if not kv.allocate_slots(request, count):
                raise ValueError("the KV pool cannot hold one chunk and its context; raise kv_cache_memory")
            table = kv.get_block_table("ppl")
            row = CachedRequestState(
                "ppl", token_ids, token_ids, request.sampling_params, (), None, table, start
            )
            inputs = runner._prepare_inputs([(row, count)])
            with set_forward_context(inputs.attention):
                hidden = runner.model(inputs.input_ids, inputs.positions)
            logits = runner.model.compute_logits(hidden)
            targets = torch.tensor(token_ids[start + 1 : start + count + 1], device=logits.device)
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            request.num_computed_tokens += count
    finally:
        kv.free(request)
    return math.exp(total / (len(token_ids) - 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmserve.benchmarks.kv_cache_ppl", description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--attention-sinks", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=4096, help="text tokens scored")
    parser.add_argument("--skip", type=int, default=0, help="corpus tokens skipped first")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per prefill step")
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)
    try:
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
                kv_cache_memory="512MiB",
            )
        )
        from llmserve.corpus import corpus_text

        ids = engine.tokenizer.encode(corpus_text()[: 6 * (args.skip + args.tokens)])[args.skip :]
        if len(ids) < args.tokens:
            raise ValueError(f"the corpus gives only {len(ids)} tokens")
        value = perplexity(engine, ids[: args.tokens], args.chunk)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    cache = engine.config.cache
    print(
        f"ppl {value:.4f}  tokens {args.tokens}  kv {cache.kv_cache_dtype}  window {cache.sliding_window}  "
        f"sinks {cache.attention_sinks}  pool tokens {cache.num_blocks * cache.block_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
