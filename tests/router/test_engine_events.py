"""The real engine publishing over ZMQ to the router's subscriber: after every burst of steps the
router's index is exactly the engine's prefix cache, evictions included."""

from __future__ import annotations

import json
import time

import pytest

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.router.events import KVEventSubscriber
from llmserve.router.index import PrefixIndex
from llmserve.router.prompt import block_hashes
from llmserve.sampling_params import SamplingParams
from tests.entrypoints.conftest import free_port
from tests.helpers import wait_until

BLOCK_SIZE = 16


def engine_and_index_of(model: str, **engine_args) -> tuple[LLMEngine, PrefixIndex, KVEventSubscriber]:
    """An engine publishing its KV events and a router's index subscribed to them (started)."""
    endpoints = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    engine = LLMEngine(
        EngineArgs(
            model=model,
            dtype="float32",
            max_model_len=256,
            block_size=BLOCK_SIZE,
            kv_events_config=json.dumps({"enable_kv_cache_events": True, **endpoints}),
            **engine_args,
        )
    )
    index = PrefixIndex(["engine"])
    subscriber = KVEventSubscriber(index)
    subscriber.add("engine", endpoints["endpoint"], endpoints["replay_endpoint"], "")
    subscriber.start()
    return engine, index, subscriber


@pytest.fixture(scope="module")
def engine_and_index(tiny_model_dir):
    # a small pool: later prompts evict earlier ones
    engine, index, subscriber = engine_and_index_of(tiny_model_dir, num_kv_blocks=12)
    yield engine, index, subscriber
    subscriber.stop()
    engine.shutdown()
    assert not engine.kv_event_publisher._thread.is_alive()  # the engine closes its publisher


def run(engine: LLMEngine, prompts: list[list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"{time.monotonic_ns()}-{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()


def synced(engine, index, subscriber):
    """Wait until the subscriber has applied every batch the engine published; the index's hashes."""
    feed = next(iter(subscriber._feeds.values()))
    wait_until(
        lambda: feed.last_seq == engine.kv_event_publisher._next_seq - 1,
        10,
        lambda: f"batch {engine.kv_event_publisher._next_seq - 1} (the subscriber has {feed.last_seq})",
        interval=0.01,
    )
    return index.stored("engine")


def test_the_index_is_the_engines_cache_and_sees_evictions(engine_and_index):
    engine, index, subscriber = engine_and_index
    pool = engine.kv_cache_manager.pool
    first = [list(range(100 + 50 * p, 100 + 50 * p + 40)) for p in range(2)]
    run(engine, first)
    cached = synced(engine, index, subscriber)
    assert cached == set(pool._cached)
    assert set(block_hashes(first[0], BLOCK_SIZE)) <= cached  # the router's hashes are the engine's
    evictions = pool.num_evictions
    run(engine, [list(range(2000 + 60 * p, 2000 + 60 * p + 60)) for p in range(3)])  # needs the whole pool
    assert pool.num_evictions > evictions
    after = synced(engine, index, subscriber)
    assert after == set(pool._cached)
    assert not set(block_hashes(first[0], BLOCK_SIZE)) <= after, "the eviction reached the index"


def test_the_routers_hashes_of_an_adapters_prompt_are_the_engines(tmp_path):
    """An adapter's request is cached under blocks whose chain starts from the adapter's key (no hit
    across adapters or with the base model); the router, given the keys /server_info reports, hashes
    the same prompt to those very blocks, and the base model's request to others."""
    from tests.helpers import make_tiny_llama_dir
    from tests.lora.adapters import make_adapter

    base = make_tiny_llama_dir(str(tmp_path / "base"))
    make_adapter(base, str(tmp_path / "qv"), 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    engine, index, subscriber = engine_and_index_of(
        base, enable_lora=True, lora_modules=(f"qv={tmp_path / 'qv'}",)
    )
    try:
        keys = engine.lora_cache_keys()
        assert set(keys) == {"qv"} and keys["qv"]
        prompt = list(range(300, 340))
        engine.add_request("adapter", prompt, SamplingParams(max_tokens=2, ignore_eos=True, lora_name="qv"))
        while engine.has_unfinished_requests():
            engine.step()
        cached = synced(engine, index, subscriber)
        adapter_hashes = block_hashes(prompt, BLOCK_SIZE, keys["qv"])
        assert len(adapter_hashes) == 2 and set(adapter_hashes) <= cached
        assert not set(block_hashes(prompt, BLOCK_SIZE)) & cached  # the base model's: not cached
    finally:
        subscriber.stop()
        engine.shutdown()
