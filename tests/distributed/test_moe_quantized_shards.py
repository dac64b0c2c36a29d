"""A mixture-of-experts file's quantized experts cut per rank (quantization/moe.py `rank_experts`),
built in this process (no process group needed to build and quantize a shard).

Under expert parallelism a rank keeps its experts' blocks whole; under tensor parallelism every
expert's gate/up rows of its units (whole rows: the blocks run along the input) and its units' input
columns of down_proj, which must hold whole groups. The oracle is plain slicing of the whole weights'
dequantization. tests/distributed/test_moe_parallel.py runs the cut shards over real ranks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from llmserve.config import EngineArgs
from llmserve.config.families import check_family_features
from llmserve.distributed.expert_parallel import ExpertLayout
from llmserve.distributed.group import TensorParallelGroup
from llmserve.model_loader import load_arch_config, load_weights
from llmserve.models.registry import build_model
from llmserve.quantization import gguf_native
from llmserve.quantization.formats import quantize_int8
from llmserve.quantization.methods import quantize_model
from llmserve.quantization.moe import QuantizedMoEExperts, expert_key, rank_experts
from llmserve.quantization.sharding import quantize_shard
from tests.quantization.test_gguf_native import _random_q4_k_blocks

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _random_q6_k_blocks(rng: np.random.Generator, rows: int, supers: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (rows, supers, 210), dtype=np.uint8)
    blocks[..., 208:210] = rng.uniform(1e-4, 2e-3, (rows, supers, 1)).astype(np.float16).view(np.uint8)
    return blocks


def _model_config(path: str, tp: int, expert_parallel: bool, **options):
    """A small float32 engine's model config for `path` at `tp` ranks."""
    args = EngineArgs(
        model=path,
        dtype="float32",
        max_model_len=128,
        kv_cache_memory="4MiB",
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        **options,
    )
    return args.create_config(load_arch_config(path), path).model


def _layer(num_experts: int, units: int, world_size: int, rank: int, expert_parallel: bool) -> nn.Module:
    """A model whose one experts module `mlp.experts` has this rank's layout (what rank_experts reads)."""
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.layout = ExpertLayout.of(num_experts, units, world_size, rank, expert_parallel)
    return model


def test_a_ranks_cut_k_quant_blocks_dequantize_to_its_part_of_the_whole():
    """Q4_K gate/up (int4 groups of 32) and Q6_K down (int8 groups of 16) of 768 units: 2 ranks hold
    384 units each, a cut in the middle of down's 256-weight super-blocks, on sub-block bounds; every
    rank's weights dequantize exactly to its rows and columns of the whole, and EP's are whole."""
    rng = np.random.default_rng(5)
    experts, hidden, units = 2, 256, 768
    whole = {}
    for expert in range(experts):
        gate_up = gguf_native._READERS["Q4_K"](_random_q4_k_blocks(rng, 2 * units, hidden // 256))
        down = gguf_native._READERS["Q6_K"](_random_q6_k_blocks(rng, hidden, units // 256))
        whole[expert_key("mlp.experts", "gate_up_proj", expert)] = gate_up
        whole[expert_key("mlp.experts", "down_proj", expert)] = down
    for rank, mine in enumerate((slice(0, 384), slice(384, 768))):
        part = rank_experts(whole, _layer(experts, units, 2, rank, expert_parallel=False))
        assert part.keys() == whole.keys()
        for expert in range(experts):
            gate, up = whole[expert_key("mlp.experts", "gate_up_proj", expert)].dequantize().chunk(2)
            got = part[expert_key("mlp.experts", "gate_up_proj", expert)]
            assert torch.equal(got.dequantize(), torch.cat([gate[mine], up[mine]]))
            down = part[expert_key("mlp.experts", "down_proj", expert)]
            assert down.group_size == 16 and down.scales.shape == (hidden, 384 // 16)
            want = whole[expert_key("mlp.experts", "down_proj", expert)].dequantize()[:, mine]
            assert torch.equal(down.dequantize(), want)
        ep = rank_experts(whole, _layer(experts, units, 2, rank, expert_parallel=True))
        assert ep.keys() == {expert_key("mlp.experts", p, 0) for p in ("gate_up_proj", "down_proj")}
        assert (
            ep[expert_key("mlp.experts", "down_proj", 0)]
            is whole[expert_key("mlp.experts", "down_proj", rank)]
        )


def test_a_share_that_cuts_a_group_is_one_line_naming_the_widths():
    """96 units over 2 ranks are 48 + 48 (runs of 8): groups of 32 straddle the cut, which the load
    refuses in one line (what a checkpoint's codes meet; a GGUF's are refused at configuration, the
    test below); expert parallelism keeps the experts whole, and one scale a row takes any cut."""
    key = expert_key("mlp.experts", "down_proj", 0)
    grouped, per_channel = quantize_int8(torch.randn(8, 96), 32), quantize_int8(torch.randn(8, 96))
    with pytest.raises(ValueError) as error:
        rank_experts({key: grouped}, _layer(1, 96, 2, 1, expert_parallel=False))
    assert str(error.value) == (
        "quantized experts mlp.experts.down_proj (groups of 32 input columns) cannot be split over "
        "tensor_parallel_size 2: rank 1's units 48..96 of each expert's 96 do not hold whole groups "
        "(--enable-expert-parallel keeps each expert whole)"
    )
    assert rank_experts({key: grouped}, _layer(2, 96, 2, 0, expert_parallel=True))[key] is grouped
    cut = rank_experts({key: per_channel}, _layer(1, 96, 2, 1, expert_parallel=False))[key]
    assert torch.equal(cut.dequantize(), per_channel.dequantize()[:, 48:])


@pytest.mark.parametrize(
    ("arch", "qtype", "expert_parallel"),
    [("qwen3moe", "Q4_0", False), ("llama", "Q8_0", True)],
    ids=["qwen3-moe-tp", "mixtral-ep"],
)
def test_each_rank_holds_its_share_of_the_files_expert_blocks(tmp_path, arch, qtype, expert_parallel):
    """`--quantization gguf` over 2 ranks: each rank's experts dequantize exactly to its part of one
    process's, and hold about half of its expert bytes."""
    from tests.models.moe_gguf import write_moe_gguf

    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_moe_gguf(path, arch, getattr(gguf.GGMLQuantizationType, qtype))

    def config(tp: int):
        return _model_config(path, tp, expert_parallel and tp > 1, quantization="gguf")

    one = build_model(config(1), load_weights(path, torch.float32))
    quantize_model(one, config(1))
    whole = {name: m for name, m in one.named_modules() if isinstance(m, QuantizedMoEExperts)}
    assert whole
    shares = []
    for rank in range(2):
        group = TensorParallelGroup(rank, 2, expert_parallel)
        shard = build_model(config(2), load_weights(path, torch.float32), group)
        quantize_shard(shard, config(2), None, lambda: None)
        for name, module in whole.items():
            layer = shard.get_submodule(name)
            assert isinstance(layer, QuantizedMoEExperts)
            layout = shard.get_submodule(name.rpartition(".")[0]).layout
            (gate_up, down), (want_gate_up, want_down) = layer.dequantize(), module.dequantize()
            experts = slice(layout.experts.start, layout.experts.stop)
            units = slice(layout.units.start, layout.units.stop)
            gate, up = want_gate_up[experts].chunk(2, dim=1)
            assert torch.equal(gate_up, torch.cat([gate[:, units], up[:, units]], dim=1)), (rank, name)
            assert torch.equal(down, want_down[experts][:, :, units]), (rank, name)
            held = len(layout.experts) / layout.num_experts if expert_parallel else units.stop - units.start
            assert held == (0.5 if expert_parallel else want_down.shape[2] // 2)
        shares.append(sum(_bytes(shard.get_submodule(name)) for name in whole))
    total = sum(_bytes(module) for module in whole.values())
    assert all(0.45 * total <= share <= 0.55 * total for share in shares), (shares, total)


def _bytes(module: nn.Module) -> int:
    return sum(buffer.numel() * buffer.element_size() for buffer in module.buffers())


def test_gguf_experts_split_where_every_share_holds_whole_blocks():
    """The configuration check: Qwen3-MoE's 64 units split 32 + 32 (whole blocks of 32), Mixtral's 96
    split 48 + 48 (not) unless the experts split whole; float, int8-rtn and int4 are not checked."""
    qwen = _arch(moe_intermediate_size=64)
    mixtral = _arch(architecture="mixtral", moe_intermediate_size=None, intermediate_size=96)
    check_family_features(qwen, "gguf", 2, None)
    check_family_features(mixtral, "gguf", 2, None, expert_parallel=True)
    for quantization in (None, "none", "int8-rtn", "int4"):
        check_family_features(mixtral, quantization, 2, None)
    with pytest.raises(ValueError) as error:
        check_family_features(mixtral, "gguf", 2, None)
    assert str(error.value) == (
        "quantization gguf cannot split the experts' 96 units over 2 tensor-parallel ranks (48 + 48) in "
        "whole blocks of 32 (--enable-expert-parallel keeps each expert whole; --quantization none serves "
        "them in float)"
    )
    prequantized = _arch(moe_intermediate_size=64, checkpoint_quantization="gptq")
    check_family_features(prequantized, None, 2, None)  # its codes are cut per rank at load


def _arch(**fields):
    from types import SimpleNamespace

    base = dict(architecture="qwen3_moe", num_experts=8, intermediate_size=128, checkpoint_quantization=None)
    return SimpleNamespace(**{**base, **fields})


def _gptq_mixtral_dir(tmp_path) -> str:
    """The tiny Mixtral family model (4 experts of 96 units) as a GPTQ checkpoint: every projection,
    experts' w1/w3/w2 included, packed in groups of 32; the router float."""
    from safetensors.torch import load_file, save_file

    from tests.models.families import make_family_dir
    from tests.quantization import prequantized_packers as packers

    path = str(tmp_path / "gptq")
    make_family_dir(path, "mixtral-top2-of-4")
    packed = {}
    for name, tensor in load_file(f"{path}/model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.startswith("model.layers.") and module.endswith(("proj", ".w1", ".w2", ".w3")):
            parts, _ = packers.gptq(tensor, group=32)
            packed.update({f"{module}.{suffix}": value for suffix, value in parts.items()})
        else:
            packed[name] = tensor
    save_file({name: value.contiguous() for name, value in packed.items()}, f"{path}/model.safetensors")
    with open(f"{path}/config.json") as file:
        fields = json.load(file)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    with open(f"{path}/config.json", "w") as file:
        json.dump({**fields, "quantization_config": gptq}, file)
    return path


@pytest.mark.full
def test_a_prequantized_checkpoints_expert_codes_are_cut_per_rank(tmp_path):
    """A GPTQ Mixtral's own expert codes under expert parallelism: each rank holds exactly its two
    experts of one process's; under tensor parallelism its 48 + 48 units cut the groups of 32: one
    line naming the widths, from every rank (each checks every rank's cuts). (Fast tier: the same
    cut of a GGUF's experts, test_each_rank_holds_its_share_of_the_files_expert_blocks, and the
    one-line error, test_a_share_that_cuts_a_group_is_one_line_naming_the_widths.)"""
    path = _gptq_mixtral_dir(tmp_path)

    def config(tp: int, expert_parallel: bool = False):
        return _model_config(path, tp, expert_parallel)

    assert config(2).quantization.method == "prequantized"
    one = build_model(config(1), load_weights(path, torch.float32))
    quantize_model(one, config(1))
    whole = {name: m.dequantize() for name, m in one.named_modules() if isinstance(m, QuantizedMoEExperts)}
    assert len(whole) == load_arch_config(path).num_hidden_layers
    for rank in range(2):
        group = TensorParallelGroup(rank, 2, expert_parallel=True)
        shard = build_model(config(2, True), load_weights(path, torch.float32), group)
        quantize_shard(shard, config(2, True), None, lambda: None)
        mine = slice(2 * rank, 2 * rank + 2)
        for name, (gate_up, down) in whole.items():
            got_gate_up, got_down = shard.get_submodule(name).dequantize()
            assert torch.equal(got_gate_up, gate_up[mine]) and torch.equal(got_down, down[mine])
        group = TensorParallelGroup(rank, 2)
        shard = build_model(config(2), load_weights(path, torch.float32), group)
        with pytest.raises(ValueError, match="rank 0's units 0..48 of each expert's 96 do not hold whole"):
            quantize_shard(shard, config(2), None, lambda: None)
