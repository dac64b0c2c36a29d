"""`llmserve serve`'s flags, generated from ServerConfig and EngineArgs: parsing, aliases, validation, and
the flags a data-parallel replica is started with. No model, no server."""

import dataclasses
import typing

import pytest

from llmserve.cli import serve
from llmserve.cli.main import build_parser
from llmserve.config import EngineArgs
from llmserve.config.flags import changed_flags
from llmserve.config.router import RoutingOptions
from llmserve.config.server import (
    API_KEY_ENV,
    ChatConfig,
    ReasoningParserName,
    ServerConfig,
    ToolCallParserName,
)


@pytest.fixture(autouse=True)
def _no_api_key_in_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def parse(*argv: str) -> tuple[ServerConfig, EngineArgs]:
    args = build_parser().parse_args(["serve", *argv])
    return ServerConfig.from_cli_args(args), EngineArgs.from_cli_args(args)


def test_no_flags_give_the_default_configs():
    assert parse() == (ServerConfig(), EngineArgs())


def test_every_field_has_a_flag_with_its_help():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for cls in (ServerConfig, ChatConfig, EngineArgs):
        for spec in dataclasses.fields(cls):
            if spec.metadata.get("aliases") is None:  # a nested config: its own fields are checked
                continue
            assert "--" + spec.name.replace("_", "-") in text
            assert spec.metadata["help"].split()[0] in text


@pytest.mark.parametrize("flag", ["--max-concurrent-requests", "--max-waiting"])
def test_max_waiting_is_an_alias_of_max_concurrent_requests(flag):
    config, _ = parse(flag, "7")
    assert config.max_concurrent_requests == 7


def test_flags_of_every_kind_parse_into_the_configs():
    config, engine = parse(
        "--port", "9001", "--no-warmup", "--metric-names", "vllm", "--max-queue-delay", "2.5",
        "--reasoning-parser", "qwen3", "--max-imbalance", "9", "-tp", "2", "--kv-cache-memory", "2GiB",
    )  # fmt: skip
    assert (config.port, config.warmup, config.metric_names, config.max_queue_delay) == (
        9001,
        False,
        "vllm",
        2.5,
    )
    assert config.chat.reasoning_parser == "qwen3" and config.routing.max_imbalance == 9
    assert engine.tensor_parallel_size == 2 and engine.kv_cache_memory == "2GiB"


def test_a_mode_outside_its_choices_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        parse("--metric-names", "prometheus")
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-waiting", "0"], "--max-concurrent-requests must be >= 1"),
        (["--max-waiting-tokens", "0"], "--max-waiting-tokens must be >= 1"),
        (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
        (["--max-queue-delay", "-1"], "--max-queue-delay must be >= 0"),
        (["--watchdog-min-seconds", "0"], "--watchdog-min-seconds must be > 0"),
        (["--watchdog-factor", "0"], "--watchdog-factor must be > 0"),
        (["--watchdog-factor", "nan"], "--watchdog-factor must be > 0"),
        (["--port", "70000"], "--port must be in"),
    ],
)
def test_bad_server_values_are_errors_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_modes_given_in_python_are_checked_too():
    with pytest.raises(ValueError, match="metric_names must be one of both, llmserve, vllm; got 'otel'"):
        ServerConfig(metric_names="otel")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        ChatConfig(tool_call_parser="mistral")


def test_the_api_key_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse()[0].api_key == "from-env"
    assert parse("--api-key", "flag")[0].api_key == "flag"
    assert "from-env" not in repr(parse()[0])


def test_the_parser_names_match_the_parser_registries():
    from llmserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from llmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

    assert set(typing.get_args(ToolCallParserName)) == set(TOOL_PARSERS)
    assert set(typing.get_args(ReasoningParserName)) == set(REASONING_PARSERS)


def test_replica_flags_reproduce_the_servers_options(tmp_path, monkeypatch):
    template = tmp_path / "t.jinja"
    monkeypatch.chdir(tmp_path)
    config, engine = parse(
        "--data-parallel-size", "2", "--port", "9000", "--api-key", "k", "--max-waiting", "3",
        "--no-engine-restart", "--chat-template", "t.jinja", "--tool-call-parser", "llama3_json",
        "--max-imbalance", "2", "--max-num-seqs", "4", "--no-prefix-caching",
    )  # fmt: skip
    flags = [*config.replica_flags(), *changed_flags(engine)]
    assert "k" not in flags and "--port" not in flags and "--max-imbalance" not in flags
    assert flags[flags.index("--chat-template") + 1] == str(template.resolve())
    replica, replica_engine = parse(*flags)
    assert replica_engine == engine
    parent_only = {"port": 8000, "api_key": None, "data_parallel_size": 1, "routing": RoutingOptions()}
    chat = dataclasses.replace(config.chat, chat_template=str(template.resolve()))
    assert replica == dataclasses.replace(config, chat=chat, **parent_only)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "2", "--nnodes", "2"], "--nnodes spreads one engine's ranks"),
        (["--node-rank", "1"], "add --headless"),
    ],
)
def test_serve_refuses_contradicting_layouts_before_loading_anything(argv, message):
    with pytest.raises(ValueError, match=message):
        serve.run(*parse(*argv))
