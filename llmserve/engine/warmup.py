"""Warm-up before ready: a fresh engine's one-time costs, paid before the server says it serves.

A fresh engine's first requests pay what later ones do not: the KV pool's pages faulting in (the
background prefault, worker/prefault.py, still running and sharing the cores), the first call of each
kernel and GEMM shape (oneDNN primitives, the compiled kernels' first dispatch), the allocator growing
to a step's temporaries, and with speculative decoding the proposer's and the verifier's first use.
`warm_up` runs a few short requests through the engine's own `step` (so tensor- and pipeline-parallel
ranks warm up too) covering those paths, then forgets them:

    A  a prompt of `prompt_len` random tokens, greedy, 3 tokens: a prefill, batch-1 decodes
    B  A's full blocks and a short suffix (a prefix-cache hit), with C: a batch of two decodes; no
       repeats, so a draft head drafts with its own network
    C  a sentence repeated, greedy: prompt lookup drafts and the greedy verifier (speculation on)
    D  another sentence repeated, seeded top-k/top-p sampling with a penalty and log-probs: the
       sampler, and the rejection sampler with drafts

First the KV prefault is finished (this thread helps the background one); afterwards the prefix
cache is emptied (a router hears `AllBlocksCleared`), the counters that reach metrics are rewound and
the global seed is set again (a seedless sampled request draws as without warm-up).
`llmserve serve --no-warmup` skips it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from llmserve.engine.llm_engine import LLMEngine
from llmserve.outputs import SpecDecodeStats
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger("llmserve")

# The warm-up prefill: past the small-batch kernels' rows, so the GEMM path and the prefill attention
# kernel run; a longer prompt costs start-up time in proportion and runs no other path.
DEFAULT_PROMPT_LEN = 128
_SUFFIX_LEN = 16  # B's new tokens after its cached prefix
_REPEATING_LEN = 48  # C's and D's prompts, a sentence repeated: prompt lookup finds matches there
_MAX_STEPS = 200  # a bound on the warm-up's steps; the requests finish in about 20


def warmup_requests(engine: LLMEngine, prompt_len: int = DEFAULT_PROMPT_LEN) -> list[list[tuple]]:
    """The warm-up's waves of (request id, prompt ids, params), each wave run to its end before the
    next; prompts fit the engine's context, step budget and pool."""
    config = engine.config
    vocab = config.model.arch.vocab_size
    block = config.cache.block_size
    pool_tokens = config.cache.num_blocks * block
    length = max(2, min(prompt_len, config.scheduler.max_num_batched_tokens, config.model.max_model_len // 2))
    length = min(length, max(2, pool_tokens // 4))
    rng = np.random.default_rng(0)
    low = min(100, vocab // 2)  # past the special tokens of common vocabularies
    a = rng.integers(low, vocab, length).tolist()
    cached = (length - 1) // block * block  # A's full blocks; at least one token of B is new
    suffix = min(_SUFFIX_LEN, max(1, config.model.max_model_len // 2 - cached))
    b = a[:cached] + rng.integers(low, vocab, suffix).tolist()
    repeat_len = max(2, min(_REPEATING_LEN, config.model.max_model_len // 2))
    c = _repeating(engine, "The cat sat on the mat. ", repeat_len, vocab)
    d = _repeating(engine, "One, two, three, four. ", repeat_len, vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        presence_penalty=0.1,
        seed=0,
        logprobs=2,
        max_tokens=6,
        ignore_eos=True,
    )
    longer = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)  # room for drafts
    waves = [[("warmup-a", a, greedy)], [("warmup-b", b, longer), ("warmup-c", c, longer)]]
    return [*waves, [("warmup-d", d, sampled)]]


def _repeating(engine: LLMEngine, text: str, length: int, vocab: int) -> list[int]:
    """`length` tokens of `text` repeated: a model continues the loop, so prompt lookup drafts."""
    ids = [token % vocab for token in engine.tokenizer.encode(text * length)]
    return ids[:length]


def warm_up(engine: LLMEngine, prompt_len: int = DEFAULT_PROMPT_LEN) -> float:
    """Finish the KV prefault, then run the warm-up requests and forget them; its seconds. A failure
    is logged and the engine serves cold (its requests are aborted): warm-up is an optimization.

    The prefault comes first and this thread helps it: the warm-up's forward passes would otherwise
    share the cores with it (their OpenMP threads spin between parallel regions)."""
    start = time.monotonic()
    engine.model_runner.wait_for_kv_prefault()
    prefaulted = time.monotonic()
    try:
        for wave in warmup_requests(engine, prompt_len):
            _run_wave(engine, wave)
    except Exception:  # noqa: BLE001 - the engine may still serve; say so and go on cold
        logger.warning("engine warm-up failed; serving without it", exc_info=True)
        for request_id in list(engine.output_processor.parents):
            engine.abort_request(request_id)
    _forget(engine)
    seconds = time.monotonic() - start
    logger.info(
        "engine warmed up in %.2f s (the rest of the KV prefault %.2f s, then requests %.2f s)",
        seconds,
        prefaulted - start,
        seconds - (prefaulted - start),
    )
    return seconds


def _run_wave(engine: LLMEngine, wave: list[tuple]) -> None:
    for request_id, prompt_ids, params in wave:
        engine.add_tokenized_request(request_id, prompt_ids, params)
    for _ in range(_MAX_STEPS):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise RuntimeError(f"the warm-up requests did not finish within {_MAX_STEPS} steps")


def _forget(engine: LLMEngine) -> None:
    """Leave no trace of the warm-up a client or metrics could see: no cached prefixes, no counts."""
    kv = engine.kv_cache_manager
    kv.pool.reset_prefix_cache()
    events = kv.take_events()
    if engine.kv_event_publisher is not None:
        engine.kv_event_publisher.publish(events)  # the router heard the blocks stored: now the clear
    kv.prefix_cache_queries = kv.prefix_cache_hits = 0
    engine.reset_step_counters()
    engine.scheduler.spec_decode_stats = SpecDecodeStats()
    torch.manual_seed(engine.config.model.seed)
