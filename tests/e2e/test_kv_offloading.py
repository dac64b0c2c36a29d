"""KV tiers under the prefix cache, end to end on a tiny random model (float32, a 12-block pool that
evicts): hits from RAM, from disk and after a restart give the tokens of an engine without tiers;
corrupt, truncated and foreign files are recomputed; a disk that cannot be written keeps serving.
The `full` ones have their fast-tier counterparts in tests/core/test_kv_tiers.py (exact ops)."""

import logging
import random
import shutil

import pytest

from llmserve import LLM, SamplingParams
from llmserve.core import kv_block_file
from llmserve.core.prefix_cache import hash_block
from tests.helpers import make_tiny_llama_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BLOCK = 16
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers, K and V, tokens, KV heads, head dim, float32
GIB = 1 << 30
PREFIX = 4 * BLOCK  # a 70-token prompt's full blocks (the last token is always computed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny-tiers")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(70)] for _ in range(5)]


@pytest.fixture(scope="module")
def expected(tiny, prompts) -> list[list[int]]:
    llm = LLM(tiny, dtype="float32", block_size=BLOCK, num_kv_blocks=12)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def tiered(model: str, ram_blocks: int, disk_dir=None, disk_blocks: int = 64, **options) -> LLM:
    disk = {}
    if disk_dir is not None:
        disk = dict(kv_offloading_disk_dir=str(disk_dir), kv_offloading_disk_size=disk_blocks * 8500 / GIB)
    return LLM(
        model,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=12,
        kv_offloading_size=ram_blocks * BLOCK_BYTES / GIB,
        kv_offloading_backend="native",
        check_invariants=True,  # the pool's integrity after every step (a load never lands in a used block)
        **disk,
        **options,
    )


def one_by_one(llm: LLM, prompts: list[list[int]]):
    return [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in prompts]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def counters(llm: LLM):
    return llm.engine.kv_cache_manager.pool.tiers.counters


def test_evicted_prefix_hits_from_ram_with_the_same_tokens_and_step_stats(
    tiny, prompts, expected, monkeypatch
):
    llm = tiered(tiny, ram_blocks=64)
    first = one_by_one(llm, prompts)  # each prompt evicts the ones before it from the 12-block pool
    steps, engine_step = [], llm.engine.step

    def step():
        outputs = engine_step()
        steps.append(llm.engine.last_step)
        return outputs

    monkeypatch.setattr(llm.engine, "step", step)
    again = one_by_one(llm, prompts)
    assert tokens(first) == expected and tokens(again) == expected
    assert [o.num_cached_tokens for o in again] == [PREFIX] * len(prompts)  # usage's cached_tokens
    assert counters(llm)["ram"].hits == 4 * len(prompts) and counters(llm)["disk"].hits == 0
    ram = [tier for stats in steps if stats is not None for tier in stats.kv_tiers if tier.tier == "ram"]
    assert sum(tier.hits for tier in ram) == 4 * len(prompts)
    assert sum(tier.bytes_loaded for tier in ram) == 4 * len(prompts) * BLOCK_BYTES
    assert sum(len(tier.load_seconds) for tier in ram) == len(prompts)  # one step of loads per prompt


def test_the_files_record_the_attention_mode(tiny, tmp_path):
    """KV made by the batch-invariant attention (--deterministic) and by the prefill kernel differ in
    their bits from the second layer on: a restart under the other setting reads other files."""
    folders = {}
    for deterministic in (False, True):
        llm = tiered(tiny, ram_blocks=1, disk_dir=tmp_path, deterministic=deterministic)
        assert llm.engine.config.model.deterministic is deterministic
        folders[deterministic] = llm.engine.model_runner.kv_tier_store.spec.disk_dir
    assert folders[False] != folders[True]
    unset = tiered(tiny, ram_blocks=1, disk_dir=tmp_path)  # float32: the runner decides off
    assert unset.engine.config.model.deterministic is False
    assert unset.engine.model_runner.kv_tier_store.spec.disk_dir == folders[False]


@pytest.mark.full  # tests/core/test_kv_tiers.py checks the same at the scheduler's level
def test_disk_hits_and_a_restart_hits_from_its_first_request(tiny, prompts, expected, tmp_path):
    llm = tiered(tiny, ram_blocks=2, disk_dir=tmp_path)
    assert tokens(one_by_one(llm, prompts)) == expected
    again = one_by_one(llm, prompts[:2])
    assert tokens(again) == expected[:2] and [o.num_cached_tokens for o in again] == [PREFIX, PREFIX]
    assert counters(llm)["disk"].hits >= 6  # at most the two RAM blocks came from RAM
    del llm

    restarted = tiered(tiny, ram_blocks=2, disk_dir=tmp_path)
    outputs = one_by_one(restarted, prompts[2:])
    assert tokens(outputs) == expected[2:]
    assert outputs[0].num_cached_tokens == PREFIX  # from the first request
    assert counters(restarted)["disk"].hits >= 4


@pytest.mark.full  # tests/core/test_kv_tiers.py checks the same at the scheduler's level
def test_corrupt_truncated_and_foreign_files_are_recomputed(tiny, prompts, expected, tmp_path):
    llm = tiered(tiny, ram_blocks=1, disk_dir=tmp_path)
    one_by_one(llm, prompts + prompts[:1])  # every prompt's full blocks reach the disk
    folder = llm.engine.model_runner.kv_tier_store.spec.disk_dir
    hashes = [block_hashes(prompt) for prompt in prompts]
    del llm
    corrupt = kv_block_file.block_path(folder, hashes[1][0])
    data = bytearray(corrupt.read_bytes())
    data[-5] ^= 1  # one bit of the KV payload
    corrupt.write_bytes(bytes(data))
    truncated = kv_block_file.block_path(folder, hashes[2][2])
    truncated.write_bytes(truncated.read_bytes()[:-100])
    other = make_tiny_llama_dir(str(tmp_path / "other"), seed=1)  # same shapes, other weights
    foreign = tiered(other, ram_blocks=1, disk_dir=tmp_path)
    one_by_one(foreign, prompts[3:] + prompts[:3])  # prompt 3's blocks reach its disk folder
    foreign_folder = foreign.engine.model_runner.kv_tier_store.spec.disk_dir
    assert foreign_folder != folder
    name = kv_block_file.block_path(folder, hashes[3][0]).name  # the same tokens hash the same
    shutil.copy(foreign_folder / name, folder / name)

    restarted = tiered(tiny, ram_blocks=1, disk_dir=tmp_path)
    outputs = one_by_one(restarted, prompts[1:4])
    assert tokens(outputs) == expected[1:4]
    assert [o.num_cached_tokens for o in outputs] == [0, 2 * BLOCK, 0]


def block_hashes(prompt: list[int]) -> list[bytes]:
    """The prompt's chained block hashes, as the prefix cache makes them (no LoRA adapter)."""
    hashes, parent = [], b""
    for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
        parent = hash_block(parent, tuple(prompt[start : start + BLOCK]))
        hashes.append(parent)
    return hashes


def test_a_disk_that_cannot_be_written_is_logged_once_and_serving_goes_on(
    tiny, prompts, expected, tmp_path, monkeypatch, caplog
):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_block_file, "write_block", disk_full)
    llm = tiered(tiny, ram_blocks=1, disk_dir=tmp_path)
    with caplog.at_level(logging.ERROR, logger="llmserve"):
        first, again = one_by_one(llm, prompts), one_by_one(llm, prompts[:2])
    assert tokens(first) == expected and tokens(again) == expected[:2]
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    assert not llm.engine.model_runner.kv_tier_store.disk_writable
    # the scheduler's side was told: it indexes no file that was never written, and takes no more
    tiers = llm.engine.kv_cache_manager.pool.tiers
    assert not tiers.disk_writable and not tiers.disk.entries


@pytest.mark.full  # tests/core/test_kv_tiers.py checks the same at the scheduler's level
def test_concurrent_requests_share_one_load_of_an_evicted_prefix(tiny, prompts, expected):
    llm = tiered(tiny, ram_blocks=64)
    one_by_one(llm, prompts)
    twins = [prompts[0], prompts[0][:PREFIX] + prompts[1][PREFIX:]]  # the same four leading blocks
    base = LLM(tiny, dtype="float32", block_size=BLOCK, num_kv_blocks=12, prefix_caching=False)
    outputs = llm.generate(twins, GREEDY, use_tqdm=False)
    assert tokens(outputs) == tokens(base.generate(twins, GREEDY, use_tqdm=False))
    assert [o.num_cached_tokens for o in outputs] == [PREFIX, PREFIX]
    assert counters(llm)["ram"].hits == 4  # loaded once, shared
