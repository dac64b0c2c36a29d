"""Prefill/decode disaggregation in one process on a tiny random model (float32): a prefill instance
(kv_producer) runs each prompt for one token, a decode instance (kv_consumer) then serves the whole
request from the blocks the prefill wrote to the shared folder, with the greedy tokens of one engine
alone; a transfer cut short (a block file missing or corrupt) is a shorter hit, never wrong KV."""

import json
import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.core import kv_block_file
from tests.helpers import make_tiny_llama_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1)
BLOCK = 16
FULL_BLOCKS = 4  # of a 70-token prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny-transfer")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(100, 40000) for _ in range(70)] for _ in range(3)]


@pytest.fixture(scope="module")
def expected(tiny, prompts) -> list[list[int]]:
    llm = LLM(tiny, dtype="float32", block_size=BLOCK, num_kv_blocks=16)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def instance(model: str, role: str, shared_dir) -> LLM:
    config = {"kv_connector": "LlmserveConnector", "kv_role": role}
    config["kv_connector_extra_config"] = {"shared_dir": str(shared_dir)}
    return LLM(
        model,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=16,
        kv_transfer_config=json.dumps(config),
        check_invariants=True,  # the pool's integrity after every step
    )


@pytest.mark.full  # tests/core/test_kv_transfer.py checks the exports and hits at the scheduler's level
def test_a_decode_instance_serves_from_the_prefill_instances_blocks_with_one_engines_tokens(
    tiny, prompts, expected, tmp_path
):
    prefill, decode = instance(tiny, "kv_producer", tmp_path), instance(tiny, "kv_consumer", tmp_path)
    prefill.generate(prompts, PREFILL, use_tqdm=False)
    (folder,) = tmp_path.iterdir()  # one model's subfolder
    assert len(list(folder.glob(f"*{kv_block_file.SUFFIX}"))) == len(prompts) * FULL_BLOCKS
    outputs = decode.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [FULL_BLOCKS * BLOCK] * len(prompts)
    assert decode.engine.kv_cache_manager.pool.tiers.counters["disk"].hits == len(prompts) * FULL_BLOCKS

    # a transfer cut short: the first prompt's third block never arrived, the second's second is corrupt
    hashes = [decode.engine.kv_cache_manager.prefix_cache.block_hashes(o) for o in _requests(prompts)]
    prefill2, decode2 = (
        instance(tiny, "kv_producer", tmp_path / "b"),
        instance(tiny, "kv_consumer", tmp_path / "b"),
    )
    prefill2.generate(prompts, PREFILL, use_tqdm=False)
    (folder,) = (tmp_path / "b").iterdir()
    kv_block_file.block_path(folder, hashes[0][2]).unlink()
    corrupt = kv_block_file.block_path(folder, hashes[1][1])
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    outputs = decode2.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [2 * BLOCK, 1 * BLOCK, FULL_BLOCKS * BLOCK]


def _requests(prompts):
    """Stand-ins with the fields the prefix cache's hashing reads."""
    from llmserve.request import Request

    return [Request(f"h{i}", prompt, GREEDY, eos_token_ids=()) for i, prompt in enumerate(prompts)]


@pytest.mark.full  # tests/core/test_kv_transfer.py checks the gloo transfer and its failures without a model
def test_the_gloo_connector_gives_the_decode_instance_the_same_hits_and_tokens(
    tiny, prompts, expected, tmp_path
):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def gloo(role: str) -> LLM:
        config = {"kv_connector": "LlmserveGlooConnector", "kv_role": role, "kv_port": port}
        config["kv_connector_extra_config"] = {"shared_dir": str(tmp_path / role), "timeout_s": 20}
        return LLM(
            tiny, dtype="float32", block_size=BLOCK, num_kv_blocks=16, kv_transfer_config=json.dumps(config)
        )

    decode = gloo("kv_consumer")  # listens first; the prefill instance connects at its first transfer
    try:
        gloo("kv_producer").generate(prompts, PREFILL, use_tqdm=False)
        assert not (tmp_path / "kv_producer").exists()  # a gloo prefill instance writes no files
        outputs = decode.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert [o.num_cached_tokens for o in outputs] == [FULL_BLOCKS * BLOCK] * len(prompts)
    finally:
        decode.engine.shutdown()
