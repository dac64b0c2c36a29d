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
    E  16 short prompts at once (at most max_num_seqs, half the pool's blocks), greedy, 3 tokens: the
       GEMMs of a wide decode batch, and steps of many rows for the cost model, so that admission
       predicts a burst's step time from its first request on

A builds the kernels; the steps of the waves after it are measured, on warm kernels: the engine
returns them to the server (EngineReady), whose wait predictor starts from them (core/wait_predictor.py)
so that admission by deadline protects even the first burst after start-up or a restart, and they are
the scheduler's step-cost model's first observations (A's are left out of it).

First the KV prefault is finished (this thread helps the background one); afterwards nothing of the
warm-up stays: a router hears none of it (KV events are held back, then dropped), the prefix cache is
emptied, the counters that reach metrics are rewound and the global seed is set again (a seedless
sampled request draws as without warm-up): `LLMEngine.reset_after_warmup`, each part resetting its
own. `llmserve serve --no-warmup` skips it: the first requests pay those costs, and the wait predictor
has no prior until steps are measured. Structured outputs' one-time costs are paid here too (about a
second): xgrammar's import while the KV prefault finishes, the vocabulary table in the grammar
compiler's thread beside the requests.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from llmserve.engine.llm_engine import LLMEngine
from llmserve.metrics.stats import StepStats
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger("llmserve")

# The warm-up prefill: past the small-batch kernels' rows, so the GEMM path and the prefill attention
# kernel run; a longer prompt costs start-up time in proportion and runs no other path.
DEFAULT_PROMPT_LEN = 128
_SUFFIX_LEN = 16  # B's new tokens after its cached prefix
_REPEATING_LEN = 48  # C's and D's prompts, a sentence repeated: prompt lookup finds matches there
_MAX_STEPS = 200  # a bound on the warm-up's steps; the requests finish in about 20
_WIDE_ROWS = 16  # E's requests: a batch past the small-batch kernels' 8 rows
_WIDE_PROMPT_LEN = 8


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
    wide = min(_WIDE_ROWS, config.scheduler.max_num_seqs, config.cache.num_blocks // 2)
    short = [rng.integers(low, vocab, _WIDE_PROMPT_LEN).tolist() for _ in range(wide)]
    e = [(f"warmup-e{i}", prompt, greedy) for i, prompt in enumerate(short)]
    return [*waves, [("warmup-d", d, sampled)], *([e] if wide > 2 else [])]


def _repeating(engine: LLMEngine, text: str, length: int, vocab: int) -> list[int]:
    """`length` tokens of `text` repeated: a model continues the loop, so prompt lookup drafts."""
    ids = [token % vocab for token in engine.tokenizer.encode(text * length)]
    return ids[:length]


def warm_up(engine: LLMEngine, prompt_len: int = DEFAULT_PROMPT_LEN) -> list[StepStats]:
    """Finish the KV prefault, then run the warm-up requests and forget them; the measured steps
    (those after the first wave). A failure is logged and the engine serves cold, without measured
    steps (its requests are aborted): warm-up is an optimization.

    The prefault comes first and this thread helps it: the warm-up's forward passes would otherwise
    share the cores with it (their OpenMP threads spin between parallel regions)."""
    start = time.monotonic()
    engine.model_runner.wait_for_kv_prefault()
    prefaulted = time.monotonic()
    # structured outputs: xgrammar's import and the vocabulary table, started beside the model's loading
    # (LLMEngine's prepare_structured_outputs) or now; done before the requests, whose imports of
    # transformers' lazy modules would race xgrammar's
    vocabulary = engine.structured_outputs_ready or engine.grammar_gate.compiler.prepare()
    try:
        vocabulary.result()
    except Exception:  # noqa: BLE001 - structured requests would then fail with the same error
        logger.warning("structured outputs' vocabulary table did not build", exc_info=True)
    prepared = time.monotonic()
    engine.begin_warmup(measure_steps=False)  # A's kernel-building steps would skew the cost model
    measured: list[StepStats] = []
    try:
        first, *rest = warmup_requests(engine, prompt_len)
        _run_wave(engine, first)
        engine.begin_warmup(measure_steps=True)
        for wave in rest:
            measured += _run_wave(engine, wave)
    except Exception:  # noqa: BLE001 - the engine may still serve; say so and go on cold
        logger.warning("engine warm-up failed; serving without it", exc_info=True)
        measured = []
        for request_id in list(engine.output_processor.parents):
            engine.abort_request(request_id)
    finally:  # whatever raised: the engine publishes KV events again and keeps no trace of the warm-up
        engine.reset_after_warmup(keep_step_costs=bool(measured))
    seconds = time.monotonic() - start
    logger.info(
        "engine warmed up in %.2f s (the rest of the KV prefault %.2f s, structured outputs %.2f s, "
        "then requests %.2f s; %d measured steps)",
        seconds,
        prefaulted - start,
        prepared - prefaulted,
        seconds - (prepared - start),
        len(measured),
    )
    return measured


def _run_wave(engine: LLMEngine, wave: list[tuple]) -> list[StepStats]:
    """Run the wave's requests to their end; the stats of its steps."""
    for request_id, prompt_ids, params in wave:
        engine.add_tokenized_request(request_id, prompt_ids, params)
    steps = []
    for _ in range(_MAX_STEPS):
        if not engine.has_unfinished_requests():
            return steps
        engine.step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
    raise RuntimeError(f"the warm-up requests did not finish within {_MAX_STEPS} steps")
