"""LoRA's parts on their own: the adapter config's checks, the LRU slot table, the flags and config."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from llmserve.config import EngineArgs
from llmserve.config.flags import changed_flags
from llmserve.config.lora import LoRAConfig
from llmserve.engine.lora_commands import LoRACommands
from llmserve.engine.messages import LoRACommandDone
from llmserve.lora.adapter import check_adapter_config, load_peft_adapter
from llmserve.lora.manager import SlotTable

PEFT_DEFAULTS = dict(
    peft_type="LORA",
    r=8,
    lora_alpha=16,
    target_modules=["q_proj", "v_proj"],
    use_dora=False,
    use_rslora=False,
    bias="none",
    rank_pattern={},
    alpha_pattern={},
    modules_to_save=None,
    layer_replication=None,
    fan_in_fan_out=False,
)


def test_scale_is_alpha_over_rank_or_its_square_root_with_rslora():
    assert check_adapter_config(PEFT_DEFAULTS, 16) == (8, 2.0)
    assert check_adapter_config({**PEFT_DEFAULTS, "use_rslora": True}, 16) == (8, 16 / math.sqrt(8))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("use_dora", True, "DoRA adapters are not supported"),
        ("bias", "all", "adapters that train biases"),
        ("rank_pattern", {"q_proj": 4}, "per-module ranks"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("target_modules", ".*proj", "regular expression"),
        ("target_modules", ["q_proj", "lm_head"], r"\['lm_head'\] are not supported"),
        ("peft_type", "IA3", "not a LoRA adapter"),
        ("r", 32, "exceeds --max-lora-rank 16"),
        ("r", 0, r"adapter rank r=0 is not a LoRA rank \(r must be >= 1\)"),
        ("r", -4, "adapter rank r=-4 is not a LoRA rank"),
    ],
)
def test_math_changing_fields_are_refused_in_one_line(field, value, message):
    with pytest.raises(ValueError, match=message) as error:
        check_adapter_config({**PEFT_DEFAULTS, field: value}, 16)
    assert "\n" not in str(error.value)


def test_slot_table_swaps_the_least_recently_used_adapter_out():
    writes = []
    table = SlotTable(2, lambda slot, name: writes.append((slot, name)))
    assert table.slots_for(["a", "b"]) == {"a": 0, "b": 1}
    assert table.slots_for(["a"]) == {"a": 0}  # b is now the least recently used
    assert table.slots_for(["c"]) == {"c": 1}
    assert table.slots_for(["a", "c"]) == {"a": 0, "c": 1}  # both resident: nothing written
    assert writes == [(0, "a"), (1, "b"), (1, "c")]
    table.release("a")
    assert table.slots_for(["b", "c"]) == {"b": 0, "c": 1}
    with pytest.raises(ValueError, match="a step uses 3 LoRA adapters; --max-loras is 2"):
        table.slots_for(["a", "b", "c"])


def test_slot_table_keeps_the_slot_of_an_adapter_that_failed_to_load():
    def write(slot, name):
        if name == "bad":
            raise ValueError("does not fit")

    table = SlotTable(1, write)
    table.slots_for(["a"])
    with pytest.raises(ValueError, match="does not fit"):
        table.slots_for(["bad"])
    assert table.slots_for(["b"]) == {"b": 0}


def test_flags_parse_and_reproduce_lora_modules():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    argv = ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2"]
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert args.lora_modules == ["a=/x", "b=/y"] and args.max_loras == 2 and args.enable_lora
    assert changed_flags(args) == argv
    assert LoRAConfig.create(True, args.lora_modules, 2, 16).modules == (("a", "/x"), ("b", "/y"))


@pytest.mark.parametrize(
    ("enable", "modules", "message"),
    [
        (False, ["a=/x"], "--lora-modules needs --enable-lora"),
        (True, ["a"], "takes name=path"),
        (True, ["a=/x", "a=/y"], "names a LoRA adapter twice"),
    ],
)
def test_lora_config_refuses_bad_modules(enable, modules, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig.create(enable, modules, 1, 16)


def test_lora_config_is_off_without_enable_lora():
    assert LoRAConfig.create(False, (), 1, 16) is None


def test_lora_commands_wait_for_the_engine_and_replay_after_a_restart():
    sent = []
    commands = LoRACommands(LoRAConfig((("a", "/a"), ("b", "/b"))), sent.append)
    commands.note_cache_keys({"a": b"key a", "b": b"key b"})  # the engine's EngineReady

    async def scenario():
        load = asyncio.ensure_future(commands.load("c", "/c"))
        await asyncio.sleep(0)
        assert not load.done() and sent[-1].name == "c"
        commands.on_done(LoRACommandDone(sent[-1].command_id, None, b"key c"))
        await load
        await _answered(commands, sent, commands.unload("a"))
        refused = asyncio.ensure_future(commands.load("d", "/d"))
        await asyncio.sleep(0)
        commands.on_done(LoRACommandDone(sent[-1].command_id, "not a PEFT adapter directory", b"key d"))
        with pytest.raises(ValueError, match="not a PEFT adapter directory"):
            await refused
        lost = asyncio.ensure_future(commands.load("e", "/e"))
        await asyncio.sleep(0)
        commands.fail_all("the engine process exited")
        with pytest.raises(ValueError, match="the engine process exited"):
            await lost

    asyncio.run(scenario())
    assert commands.names == ("b", "c")
    assert commands.cache_keys() == {"b": b"key b", "c": b"key c"}  # what /server_info gives a router
    sent.clear()
    commands.replay()  # a new engine process starts with --lora-modules: c again, a unloaded again
    assert [(command.name, command.path) for command in sent] == [("a", None), ("c", "/c")]

    async def reload_b():  # unloaded, then loaded again from another directory: other weights
        await _answered(commands, sent, commands.unload("b"))
        await _answered(commands, sent, commands.load("b", "/b2"), key=b"key b2")

    asyncio.run(reload_b())
    commands.note_cache_keys({"a": b"key a", "b": b"key b"})  # a restarted engine's start adapters
    assert commands.cache_keys() == {"b": b"key b2", "c": b"key c"}


async def _answered(commands, sent, command, key: bytes = b"") -> None:
    """Run a load or unload whose command the engine answers as done (with `key` for a load)."""
    task = asyncio.ensure_future(command)
    await asyncio.sleep(0)
    commands.on_done(LoRACommandDone(sent[-1].command_id, None, key))
    await task


def test_lora_commands_replay_a_snapshot_while_the_adapters_change():
    """replay() runs on the reader thread while the event loop loads and unloads: an adapter loaded
    between two of its sends changes what it iterates not at all."""
    sent = []

    def send(command):
        sent.append(command)
        commands.adapters[f"late-{len(sent)}"] = "/late"  # the event loop's load, meanwhile

    commands = LoRACommands(LoRAConfig((("a", "/a"),)), send)
    commands.adapters.update({"b": "/b", "c": "/c"})
    commands.replay()
    assert [(command.name, command.path) for command in sent] == [("b", "/b"), ("c", "/c")]


def _write_peft_dir(path, modules: list[str]) -> str:
    """A rank-2 PEFT directory with a q_proj A/B pair under each of `modules` (key prefixes)."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({**PEFT_DEFAULTS, "r": 2}))
    tensors = {}
    for prefix in modules:
        tensors[f"{prefix}.layers.0.self_attn.q_proj.lora_A.weight"] = torch.ones(2, 8)
        tensors[f"{prefix}.layers.0.self_attn.q_proj.lora_B.weight"] = torch.ones(8, 2)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


@pytest.mark.parametrize(
    "prefix",
    [
        "base_model.model.model",
        "base_model.model",
        "base_model.model.language_model.model",
        "model.language_model",
    ],
)
def test_adapter_keys_of_the_text_model_are_read(tmp_path, prefix):
    adapter = load_peft_adapter("x", _write_peft_dir(tmp_path / "x", [prefix]), 16, torch.float32)
    assert list(adapter.weights) == [(0, "q_proj")]


@pytest.mark.parametrize(
    ("prefixes", "message"),
    [
        (
            [
                "base_model.model.model.language_model",
                "base_model.model.model.vision_tower.vision_model.encoder",
            ],
            "outside the language model's decoder layers",
        ),
        (
            ["base_model.model.model", "base_model.model.language_model.model"],
            "has lora_A of q_proj in layer 0 twice",
        ),
    ],
)
def test_adapter_keys_of_other_towers_or_twice_are_refused_in_one_line(tmp_path, prefixes, message):
    with pytest.raises(ValueError, match=message) as error:
        load_peft_adapter("x", _write_peft_dir(tmp_path / "x", prefixes), 16, torch.float32)
    assert "\n" not in str(error.value)
