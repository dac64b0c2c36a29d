"""Prefill/decode disaggregation without a model: the --kv-transfer-config flag, the blocks a prefill
instance exports and when (core/kv_transfer.py), a decode instance's tiers finding a block file that
arrived in the shared folder (core/kv_tiers.py), the shared-folder connector's files
(worker/kv_transfer.py) and the router's prefill request (router/disaggregation.py)."""

import json

import pytest
import torch

from llmserve.config import SchedulerConfig
from llmserve.config.kv_transfer import KVTransferConfig
from llmserve.core import kv_block_file
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_tiers import TIER_BLOCK, TierSpec
from llmserve.core.kv_transfer import ExportPlanner, KVExport
from llmserve.core.scheduler import Scheduler
from llmserve.router.disaggregation import prefill_request
from tests.helpers import wait_until

from .test_scheduler import finish_step

KEY = b"m" * 32
BLOCK_BYTES = 64
PROMPT = list(range(100, 111))  # two full blocks of 4, and 3 tokens


def transfer(role="kv_producer", **extra) -> str:
    extra = {"shared_dir": "/tmp/kv", **extra}
    return json.dumps(
        {"kv_connector": "LlmserveConnector", "kv_role": role, "kv_connector_extra_config": extra}
    )


def test_the_flag_takes_vllms_keys_and_refuses_what_it_does_not_know_in_one_line():
    config = KVTransferConfig.from_json(transfer("kv_both", shared_size_gib=0.5))
    assert (config.produces, config.consumes, config.shared_dir, config.shared_bytes) == (
        True,
        True,
        "/tmp/kv",
        1 << 29,
    )
    assert KVTransferConfig.from_json(transfer("kv_consumer")).produces is False
    bad = {
        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}': "unknown kv_connector 'NixlConnector'",
        transfer("kv_decoder"): "kv_role must be one of",
        transfer(kv_ip="10.0.0.1"): "unknown kv_connector_extra_config keys ['kv_ip']",
        '{"kv_connector": "LlmserveConnector", "kv_role": "kv_producer", "kv_rank": 0}': "unknown keys",
        '{"kv_connector": "LlmserveConnector", "kv_role": "kv_producer"}': "shared_dir must name a folder",
        transfer(shared_size_gib=0): "shared_size_gib must be a positive number",
        "{not json": "not valid JSON",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
            KVTransferConfig.from_json(text)
        assert "\n" not in str(error.value)


def producer(budget=64):
    kv = KVCacheManager(16, block_size=4)
    planner = ExportPlanner(kv.prefix_cache, kv.get_block_table, 4)
    return Scheduler(SchedulerConfig(budget, 8, 1000), kv, kv_exports=planner), kv


def test_a_prefill_instance_exports_a_prompts_full_blocks_in_the_step_that_finishes_the_prompt(make_request):
    scheduler, kv = producer(budget=6)  # the 11-token prompt takes two chunks
    request = make_request(0, tokens=PROMPT, max_tokens=2)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.plan.kv_exports == []  # the prompt is not all computed after this step
    finish_step(scheduler, first)
    second = scheduler.schedule()
    table, hashes = kv.get_block_table(request.request_id), kv.prefix_cache.block_hashes(request)
    assert second.plan.kv_exports == [
        KVExport(table[0], hashes[0], tuple(PROMPT[:4])),
        KVExport(table[1], hashes[1], tuple(PROMPT[4:8])),
    ]
    finish_step(scheduler, second)
    assert scheduler.schedule().plan.kv_exports == []  # its decode steps export nothing


def test_an_engine_without_a_planner_exports_nothing(make_request):
    kv = KVCacheManager(16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(64, 8, 1000), kv)
    scheduler.add_request(make_request(0, tokens=PROMPT, max_tokens=1))
    assert scheduler.schedule().plan.kv_exports == []


def consumer(tmp_path, shared=True, disk_blocks=8):
    spec = TierSpec(4, tmp_path, disk_blocks, KEY, BLOCK_BYTES, disk_read_threads=0, shared=shared)
    kv = KVCacheManager(8, block_size=4, tiers=spec)
    return Scheduler(SchedulerConfig(64, 8, 1000), kv), kv


def write_prompt_blocks(directory, kv, request, payload=b"k" * BLOCK_BYTES, key=KEY):
    """Write the request's full prompt blocks as a prefill instance would (after the consumer started)."""
    for index, block_hash in enumerate(kv.prefix_cache.block_hashes(request)[:2]):
        tokens = tuple(PROMPT[4 * index : 4 * index + 4])
        kv_block_file.write_block(
            kv_block_file.block_path(directory, block_hash), key, block_hash, tokens, payload
        )


def test_a_decode_instance_hits_the_blocks_a_prefill_instance_wrote_after_it_started(tmp_path, make_request):
    scheduler, kv = consumer(tmp_path)
    request = make_request(0, tokens=PROMPT, max_tokens=1)
    assert kv.get_computed_blocks(request) == []  # nothing arrived yet
    write_prompt_blocks(tmp_path, kv, request)
    assert kv.get_computed_blocks(request) == [TIER_BLOCK, TIER_BLOCK]
    scheduler.add_request(request)
    output = scheduler.schedule()
    loads = [op for op in output.plan.tier_ops if op.kind == "load_bytes"]
    assert [op.payload for op in loads] == [b"k" * BLOCK_BYTES] * 2
    assert request.num_computed_tokens == 8 and output.plan.num_scheduled_tokens[request.request_id] == 3
    assert kv.pool.tiers.counters["disk"].hits == 2


def test_a_decode_instance_ignores_a_foreign_or_truncated_file_and_an_unshared_folder(tmp_path, make_request):
    _, kv = consumer(tmp_path)
    request = make_request(0, tokens=PROMPT, max_tokens=1)
    write_prompt_blocks(tmp_path, kv, request, key=b"x" * 32)  # another model's blocks
    assert kv.get_computed_blocks(request) == []
    write_prompt_blocks(tmp_path, kv, request, payload=b"k" * (BLOCK_BYTES - 1))  # another pool shape
    assert kv.get_computed_blocks(request) == []
    write_prompt_blocks(tmp_path, kv, request)
    first = kv_block_file.block_path(tmp_path, kv.prefix_cache.block_hashes(request)[0])
    first.write_bytes(first.read_bytes()[:-5])  # a truncated first block: no hit at all
    assert kv.get_computed_blocks(request) == []
    other = tmp_path / "other"
    other.mkdir()
    _, unshared = consumer(other, shared=False)  # an ordinary disk tier indexes its folder at start only
    write_prompt_blocks(other, unshared, request)
    assert unshared.get_computed_blocks(make_request(0, tokens=PROMPT, max_tokens=1)) == []


def test_the_shared_folder_connector_writes_checked_files_a_decode_instance_reads(tmp_path):
    from llmserve.worker.kv_transfer import SharedFolderConnector

    connector = SharedFolderConnector.__new__(SharedFolderConnector)  # no model: the pool and key set here
    connector.kv_blocks = torch.arange(2 * 2 * 3 * 4 * 1 * 2, dtype=torch.float32).view(2, 2, 3, 4, 1, 2)
    connector.model_key, connector.directory, connector.failed = KEY, tmp_path, False
    connector.send([KVExport(1, b"h" * 32, (5, 6, 7, 8))])
    path = kv_block_file.block_path(tmp_path, b"h" * 32)
    payload = kv_block_file.read_block(path, KEY, b"h" * 32, (5, 6, 7, 8))
    expected = connector.kv_blocks[:, :, 1].contiguous()
    assert torch.equal(
        torch.frombuffer(bytearray(payload), dtype=torch.float32).view(expected.shape), expected
    )
    connector.send([KVExport(2, b"h" * 32, (5, 6, 7, 8))])  # sent before: the file is left as it is
    assert kv_block_file.read_block(path, KEY, b"h" * 32, (5, 6, 7, 8)) == payload


def test_the_router_asks_a_prefill_instance_for_one_token_not_streamed():
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 2,
        "min_tokens": 5,
        "temperature": 0,
    }
    assert prefill_request(request) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "max_tokens": 1,
    }
    assert request["stream"] is True  # the decode instance gets the request as sent


def test_a_decode_instances_disk_tier_is_the_shared_folder_and_both_roles_take_the_tiers_refusals():
    from llmserve.config import EngineArgs
    from llmserve.model_loader import default_model_path, load_arch_config

    arch = load_arch_config(default_model_path())
    args = dict(device="cpu", dtype="float32", max_model_len=512)
    decode = EngineArgs(**args, kv_transfer_config=transfer("kv_consumer", shared_size_gib=1)).create_config(
        arch, "m"
    )
    tiers = decode.cache.kv_offloading
    assert (tiers.disk_dir, tiers.disk_bytes, tiers.ram_bytes) == ("/tmp/kv", 1 << 30, 1 << 30)
    assert decode.cache.kv_transfer.consumes
    prefill = EngineArgs(**args, kv_transfer_config=transfer()).create_config(arch, "m")
    assert prefill.cache.kv_offloading is None and prefill.cache.kv_transfer.produces
    with pytest.raises(ValueError, match="--kv-transfer-config does not combine with --no-prefix-caching"):
        EngineArgs(**args, kv_transfer_config=transfer(), prefix_caching=False).create_config(arch, "m")
    own_disk = dict(kv_offloading_size=1, kv_offloading_disk_dir="/tmp/other", kv_offloading_disk_size=1)
    with pytest.raises(ValueError, match="its shared_dir"):
        EngineArgs(**args, **own_disk, kv_transfer_config=transfer("kv_consumer")).create_config(arch, "m")
    with pytest.raises(ValueError, match="unknown kv_connector"):
        EngineArgs(kv_transfer_config='{"kv_connector": "X", "kv_role": "kv_both"}')


def free_address() -> tuple[str, int]:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return "127.0.0.1", probe.getsockname()[1]


def pool() -> torch.Tensor:
    """A pool of 3 blocks as [layers, 2, blocks, block_size 4, kv_heads, row]."""
    return torch.arange(2 * 2 * 3 * 4 * 1 * 2, dtype=torch.float32).view(2, 2, 3, 4, 1, 2)


EXPORTS = [KVExport(2, b"a" * 32, (1, 2, 3, 4)), KVExport(0, b"b" * 32, (5, 6, 7, 8))]


def test_gloo_sends_blocks_the_receiver_writes_as_checked_files_and_refuses_another_models(tmp_path):
    from llmserve.worker.kv_transfer import GlooConnector, GlooReceiver

    address, blocks = free_address(), pool()
    receiver = GlooReceiver(tmp_path, KEY, address, timeout_s=5)
    GlooConnector(blocks, KEY, address, timeout_s=5).send(EXPORTS)
    assert receiver.received == 2  # the send returned after the acknowledgement: the files are there
    for export in EXPORTS:
        path = kv_block_file.block_path(tmp_path, export.block_hash)
        payload = kv_block_file.read_block(path, KEY, export.block_hash, export.tokens)
        assert payload == blocks[:, :, export.block].contiguous().numpy().tobytes()
    other = KVExport(1, b"c" * 32, (9, 9, 9, 9))
    GlooConnector(blocks, b"x" * 32, address, timeout_s=5).send([other])  # another model's blocks
    assert receiver.received == 2 and not kv_block_file.block_path(tmp_path, b"c" * 32).exists()
    receiver.close()


def test_gloo_transfers_that_fail_never_raise_nor_stall_each_step(tmp_path, caplog):
    import torch.distributed as dist

    from llmserve.worker.kv_transfer import GlooConnector, GlooReceiver

    nobody = GlooConnector(pool(), KEY, free_address(), timeout_s=1)
    nobody.send(EXPORTS)  # no decode instance listens: logged, not raised
    assert "KV transfer to" in caplog.text and nobody.retry_at > 0
    nobody.send(EXPORTS)  # skipped at once until the retry time (one timeout per outage, not per step)
    assert nobody.store is None

    address = free_address()
    receiver = GlooReceiver(tmp_path, KEY, address, timeout_s=1)
    sender = dist.TCPStore(*address, is_master=False)  # a prefill instance that dies mid-transfer:
    sequence = sender.add("kv-transfer-seq", 1)
    sender.queue_push("kv-transfers", str(sequence))
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"kv-transfer-{sequence}", sender), 0, 2, receiver.timeout)
    group.send([torch.tensor([1, 4, 64])], 1, 0).wait()  # its first tensor only
    del group
    wait_until(lambda: "KV transfer 1 failed" in caplog.text, 10, "the receiver's log of the broken transfer")
    GlooConnector(pool(), KEY, address, timeout_s=5).send(EXPORTS)  # the receiver still takes the next one
    assert receiver.received == 2
    receiver.close()
    assert not receiver.is_alive()


def prefill_stage(answer):
    """A prefill stage over prefill instances p0 and p1 answering with `answer(request)`; (run's results,
    the bodies they were sent, the outcomes counted, the replicas)."""
    import asyncio

    import httpx

    from llmserve.router.disaggregation import PrefillStage
    from llmserve.router.replica import Replica
    from tests.router.test_routing_units import INFO

    sent, outcomes = [], []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.host, json.loads(request.content)))
        return answer(request)

    replicas = [Replica(f"http://p{i}", INFO) for i in range(2)]
    replicas[0].in_flight = 3  # p1 is the least loaded

    async def go():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        stage = PrefillStage(client, replicas, 5.0, lambda url, done: outcomes.append((url, done)))
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 9, "stream": True}
        return [await stage.run("/v1/completions", body, {}), await stage.run("/v1/embeddings", body, {})]

    return asyncio.run(go()), sent, outcomes, replicas


def test_the_prefill_stage_sends_one_token_to_the_least_loaded_and_skips_what_fails():
    import httpx

    results, sent, outcomes, replicas = prefill_stage(lambda request: httpx.Response(200, json={}))
    assert results == [True, False]  # embeddings never take a prefill
    assert sent == [("p1", {"model": "m", "prompt": [1, 2], "max_tokens": 1})]
    assert outcomes == [("http://p1", True)] and replicas[1].in_flight == 0

    results, _, outcomes, replicas = prefill_stage(lambda request: httpx.Response(500, json={}))
    assert results[0] is False and outcomes == [("http://p1", False)] and replicas[1].healthy

    def dies(request):
        raise httpx.ReadTimeout("timed out")  # as a prefill instance that hangs past --prefill-timeout

    results, _, outcomes, replicas = prefill_stage(dies)
    assert results[0] is False and outcomes == [("http://p1", False)] and not replicas[1].healthy
