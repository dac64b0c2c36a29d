"""The router's parts without a model: index, policy, prompt hashing, stream hold-back, CPU split, flags."""

import pytest

from llmserve.config.kv_events import KVEventsConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_events import (
    BLOCK_HASH_SCHEME,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from llmserve.entrypoints.openai.server_info import KVEventsEndpoints, ServerInfo
from llmserve.request import Request
from llmserve.router import data_parallel
from llmserve.router.data_parallel import split_cpus
from llmserve.router.events import connect_endpoint
from llmserve.router.index import PrefixIndex
from llmserve.router.policy import RoutingPolicy
from llmserve.router.prompt import block_hashes
from llmserve.router.proxy import _carries_output
from llmserve.router.replica import Replica, check_compatible
from llmserve.sampling_params import SamplingParams

INFO = ServerInfo(
    model="m",
    max_model_len=64,
    block_size=4,
    hash_scheme=BLOCK_HASH_SCHEME,
    prefix_caching=True,
    tokenizer_fingerprint="abc",
    kv_events=KVEventsEndpoints(endpoint="tcp://*:5557", replay_endpoint=None, topic=""),
)
A, B = block_hashes(list(range(16)), 4), block_hashes(list(range(100, 116)), 4)


def batch(*events):
    return KVEventBatch(ts=0.0, events=list(events))


def stored(hashes):
    return BlockStored(hashes, None, [0] * 4 * len(hashes), 4, None, None)


def make_policy(loads=(0, 0), max_imbalance=2):
    replicas = [Replica(f"http://r{i}", INFO) for i in range(len(loads))]
    for replica, load in zip(replicas, loads, strict=True):
        replica.in_flight = load
    index = PrefixIndex([r.url for r in replicas], pending_seconds=5.0)
    return RoutingPolicy(index, max_imbalance), index, replicas


def test_router_hashes_equal_the_engines_block_hashes():
    tokens = list(range(3, 3 + 19))
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = Request("r", tokens, SamplingParams(), eos_token_ids=(2,))
    assert block_hashes(tokens, 4) == kv.prefix_cache.block_hashes(request)
    assert len(block_hashes(tokens, 4)) == 4


def test_index_follows_stored_removed_and_cleared_and_matches_leading_blocks():
    index = PrefixIndex(["r"])
    index.apply("r", batch(stored(A)))
    assert index.match("r", A) == 4 and index.match("r", B) == 0
    index.apply("r", batch(BlockRemoved([A[2]], None)))
    assert index.match("r", A) == 2  # a hole ends the prefix even though block 3 is still there
    index.apply("r", batch(AllBlocksCleared()))
    assert index.match("r", A) == 0


def test_a_routed_prompt_counts_as_cached_there_until_its_pending_entry_expires():
    index = PrefixIndex(["r"], pending_seconds=5.0)
    index.note_routed("r", A, now=100.0)
    assert index.match("r", A, now=104.0) == 4
    assert index.match("r", A, now=106.0) == 0


def test_expired_pending_entries_are_swept_so_the_index_stays_bounded():
    index = PrefixIndex(["r"], pending_seconds=5.0)
    for step in range(3000):  # 3 blocks a prompt, one prompt a second: about 15 s worth are live
        index.note_routed("r", block_hashes([step, *range(47)], 16), now=float(step))
    assert index.num_pending("r") <= 4096 + 3


def test_prefix_owner_wins_within_the_imbalance_bound_and_spills_past_it():
    policy, index, (r0, r1) = make_policy(loads=(2, 0), max_imbalance=2)
    index.apply(r0.url, batch(stored(A)))
    choice = policy.choose([r0, r1], A)
    assert (choice.replica, choice.matched_blocks, choice.by_prefix) == (r0, 4, True)
    r0.in_flight = 3  # 3 more than r1: past the bound
    choice = policy.choose([r0, r1], A)
    assert (choice.replica, choice.by_prefix) == (r1, False)


def test_longest_prefix_wins_over_a_shorter_one():
    policy, index, (r0, r1) = make_policy()
    index.apply(r0.url, batch(stored(A[:1])))
    index.apply(r1.url, batch(stored(A[:3])))
    assert policy.choose([r0, r1], A).replica is r1


def test_unique_prompts_alternate_between_equally_loaded_replicas():
    policy, _, replicas = make_policy(loads=(0, 0, 0))
    picks = [policy.choose(replicas, B).replica.url for _ in range(6)]
    assert sorted(picks) == sorted([r.url for r in replicas] * 2)


def test_least_loaded_counts_the_replicas_own_metrics_and_kv_usage():
    policy, _, (r0, r1) = make_policy()
    r0.num_waiting = 5
    assert policy.choose([r0, r1], []).replica is r1
    r0.num_waiting, r1.kv_cache_usage = 0, 0.5
    assert policy.choose([r0, r1], []).replica is r0
    assert policy.choose([], A) is None


@pytest.mark.parametrize(
    ("event", "carries"),
    [
        (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', False),
        (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}', True),
        (b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}', False),
        (b'data: {"choices":[{"index":0,"text":" a","finish_reason":null}]}', True),
        (b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}', True),
        (b'data: {"error":{"message":"x"}}', True),
        (b"data: [DONE]", True),
        (b'event: response.created\ndata: {"type":"response.created","response":{}}', False),
        (b'event: response.in_progress\ndata: {"type":"response.in_progress","response":{}}', False),
        (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}', True),
    ],
)
def test_stream_events_before_any_output_are_held_back(event, carries):
    assert _carries_output(event) is carries


def test_wildcard_endpoints_connect_to_the_replicas_host():
    assert connect_endpoint("tcp://*:5557", "http://10.0.0.2:8000") == "tcp://10.0.0.2:5557"
    assert connect_endpoint("tcp://0.0.0.0:5557", "http://host:8000") == "tcp://host:5557"
    assert connect_endpoint("tcp://127.0.0.1:9", "http://host:8000") == "tcp://127.0.0.1:9"


def test_cpus_split_evenly_by_core_and_replicas_share_when_there_are_too_few(monkeypatch):
    monkeypatch.setattr(data_parallel, "_group_by_core", lambda cpus: [[cpu] for cpu in cpus])
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([0], 2) == [[0], [0]]
    monkeypatch.setattr(data_parallel, "_group_by_core", lambda cpus: [[0, 2], [1, 3]])  # SMT siblings
    assert split_cpus([0, 1, 2, 3], 2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 16}, "has block_size 16, but the router expects 4"),
        ({"hash_scheme": "xxhash"}, "hashes blocks with 'xxhash'"),
        ({"tokenizer_fingerprint": "zzz"}, "has tokenizer_fingerprint 'zzz'"),
        ({"kv_events": None}, "publishes no KV events"),
        ({"prefix_caching": False}, "without prefix caching"),
    ],
)
def test_an_incompatible_replica_is_a_one_line_error(change, message):
    with pytest.raises(ValueError, match=message) as error:
        check_compatible("http://x", INFO.model_copy(update=change), INFO)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"endpoint": "tcp://*:1", "port": 3}', "unknown keys \\['port'\\]"),
        ('{"publisher": "kafka"}', "publisher must be one of"),
        ('{"buffer_steps": 0}', "buffer_steps must be a positive integer"),
    ],
)
def test_bad_kv_events_config_is_a_one_line_error(text, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)


def test_kv_events_config_takes_vllms_keys():
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100}'
    )
    assert config.enabled and config.replay_endpoint == "tcp://*:5558" and config.buffer_steps == 100
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled


def test_replicas_get_the_chat_flags(tmp_path):
    from llmserve.cli.main import build_parser
    from llmserve.config import EngineArgs
    from llmserve.config.server import ServerConfig

    def replica_flags(argv: list[str]) -> list[str]:
        args = build_parser().parse_args(argv)
        return data_parallel._replica_flags(ServerConfig.from_cli_args(args), EngineArgs.from_cli_args(args))

    template = tmp_path / "t.jinja"
    argv = ["serve", "--data-parallel-size", "2", "--chat-template", str(template)]
    flags = replica_flags([*argv, "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"])
    assert flags[flags.index("--chat-template") + 1] == str(template.resolve())
    assert flags[flags.index("--tool-call-parser") + 1] == "llama3_json"
    assert flags[flags.index("--reasoning-parser") + 1] == "qwen3"
    assert "--tool-call-parser" not in replica_flags(argv[:3])


def test_the_router_keeps_the_adapter_keys_its_replicas_agree_on():
    """A name whose key differs between replicas (other weights loaded under it) is hashed as the
    base model's request: a cache miss at worst, never another adapter's blocks."""
    from llmserve.router.app import agreed_lora_keys

    def info(keys):
        return INFO.model_copy(update={"lora_cache_keys": keys})

    infos = [info({"a": "aa", "b": "bb"}), info({"a": "aa", "b": "cc", "c": "dd"})]
    assert agreed_lora_keys(infos) == {"a": b"\xaa", "c": b"\xdd"}


def test_after_a_load_the_router_reads_the_keys_again_from_the_healthy_replicas():
    import asyncio
    import types

    import httpx

    from llmserve.router.app import _refresh_lora_keys

    answers = {"http://a": {"x": "01"}, "http://b": {"x": "01", "y": "02"}}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/server_info"
        info = INFO.model_copy(update={"lora_cache_keys": answers[f"http://{request.url.host}"]})
        return httpx.Response(200, content=info.model_dump_json())

    replicas = [types.SimpleNamespace(url=url, healthy=True) for url in answers]
    replicas.append(types.SimpleNamespace(url="http://down", healthy=False))  # not asked
    state = types.SimpleNamespace(replicas=replicas, lora_keys={})

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            state.proxy = types.SimpleNamespace(client=client)
            await _refresh_lora_keys(state)

    asyncio.run(scenario())
    assert state.lora_keys == {"x": b"\x01", "y": b"\x02"}
