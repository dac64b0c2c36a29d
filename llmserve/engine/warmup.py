"""The engine process's warm-up, between loading the model and taking requests: two short greedy
requests run through the whole engine (scheduler, forward, sampler, output processing).

The first builds kernels and faults pages in; the steps of the second are the measured prior that
the server's wait predictor starts from (core/wait_predictor.py), so that admission by deadline
protects even the first burst after start-up or a restart. Nothing of the warm-up stays: its prefix
cache entries, KV events and speculative-decoding counters are dropped and the seed is set again.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from llmserve.engine.llm_engine import LLMEngine, check_prompt
from llmserve.metrics.stats import StepStats
from llmserve.outputs import SpecDecodeStats
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger("llmserve")

_PROMPT_TOKENS = 32  # one prefill of this many tokens, then decode steps
_MAX_TOKENS = 4
_REQUEST_IDS = ("warmup-kernels", "warmup-measured")


def warm_up(engine: LLMEngine) -> list[StepStats]:
    """Run the warm-up; the steps of its measured request (empty if no prompt fits this engine)."""
    start = time.monotonic()
    publisher, engine.kv_event_publisher = engine.kv_event_publisher, None  # a router must not see it
    try:
        cost_model = copy.deepcopy(engine.scheduler.cost_model)
        _run(engine, _REQUEST_IDS[0], offset=1)
        engine.scheduler.cost_model = cost_model  # the kernel-building steps would skew its fit
        steps = _run(engine, _REQUEST_IDS[1], offset=2)
    finally:
        engine.kv_event_publisher = publisher
        for request_id in _REQUEST_IDS:  # left by a step that raised
            if engine.output_processor.has_request(request_id):
                engine.abort_request(request_id)
    engine.kv_cache_manager.pool.reset_prefix_cache()
    engine.kv_cache_manager.take_events()
    engine.scheduler.spec_decode_stats = SpecDecodeStats()
    engine.last_step = None
    torch.manual_seed(engine.config.model.seed)
    logger.info(
        "warm-up done in %.2f s (%d measured steps, %d tokens)",
        time.monotonic() - start,
        len(steps),
        sum(s.num_prompt_tokens + s.num_generation_tokens for s in steps),
    )
    return steps


def _run(engine: LLMEngine, request_id: str, offset: int) -> list[StepStats]:
    """One greedy request of a synthetic prompt (distinct per `offset`: no prefix-cache hit) to its end."""
    config = engine.config
    pool_tokens = config.cache.num_blocks * config.cache.block_size
    length = min(_PROMPT_TOKENS, config.model.max_model_len, pool_tokens) - _MAX_TOKENS - 1
    if length < 1:  # a context or KV pool too small for it: serve without a measured prior
        return []
    vocab = config.model.arch.vocab_size
    prompt = [(offset + 7 * index) % vocab for index in range(length)]
    check_prompt(prompt, config)
    params = SamplingParams(max_tokens=_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_tokenized_request(request_id, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
    return steps
