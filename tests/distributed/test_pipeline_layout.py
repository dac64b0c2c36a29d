"""How pipeline parallelism splits the layers and lays out the ranks, its KV capacity per stage, and
what it refuses (no ranks started)."""

import subprocess
import sys

import pytest

from llmserve.config import EngineArgs
from llmserve.config.parallel import stage_layer_ranges
from llmserve.distributed.pipeline import PipelineLayout, PipelineStage
from tests.distributed.test_shard import ARCH  # the default model's shape: 30 layers, 3 KV heads


def test_layers_split_evenly_with_the_remainder_before_the_last_stage():
    assert stage_layer_ranges(30, 2) == [range(0, 15), range(15, 30)]
    assert stage_layer_ranges(30, 4) == [range(0, 7), range(7, 15), range(15, 23), range(23, 30)]
    assert stage_layer_ranges(3, 2) == [range(0, 2), range(2, 3)]
    assert stage_layer_ranges(5, 5) == [range(i, i + 1) for i in range(5)]
    assert stage_layer_ranges(7, 1) == [range(0, 7)]


def test_the_first_stage_embeds_and_the_last_projects():
    first, last = (PipelineStage.of(3, 2, stage) for stage in range(2))
    assert (first.layers, first.is_first, first.is_last) == (range(0, 2), True, False)
    assert (last.layers, last.is_first, last.is_last) == (range(2, 3), False, True)
    whole = PipelineStage.whole(3)
    assert whole.is_first and whole.is_last and whole.layers == range(3)


def test_ranks_are_laid_out_tensor_parallel_rank_fastest():
    layout = PipelineLayout(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.world_size == 6
    assert [(layout.stage_of(r), layout.tp_rank_of(r)) for r in range(6)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert layout.stage_ranks(1) == [2, 3] and layout.rank_of(2, 1) == 5


def test_each_stage_pools_its_own_layers_so_capacity_grows_with_the_stages():
    one_layer_block = 2 * 3 * 64 * 4 * 32  # K and V, 3 KV heads, head_dim 64, float32, 32 tokens
    memory = 60 * one_layer_block

    def blocks(**parallel) -> int:
        args = EngineArgs(kv_cache_memory=memory, dtype="float32", device="cpu", **parallel)
        return args.create_config(ARCH, "model").cache.num_blocks

    # the fullest stage's layers: 30, 15, 8 (of 7/8/8/7); with TP=2 also 2 of the 3 KV heads
    assert blocks() == 2
    assert blocks(pipeline_parallel_size=2) == 4
    assert blocks(pipeline_parallel_size=4) == 60 // 8
    assert blocks(pipeline_parallel_size=2, tensor_parallel_size=2) == 60 * 3 // (15 * 2)


def test_more_stages_than_layers_is_a_one_line_error():
    with pytest.raises(
        ValueError, match="pipeline_parallel_size 31 leaves a stage with no decoder layer"
    ) as error:
        EngineArgs(pipeline_parallel_size=31).create_config(ARCH, "model")
    assert "the model has 30 layers" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="leaves a stage with no decoder layer"):
        stage_layer_ranges(2, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
        (
            dict(pipeline_parallel_size=2, speculative_method="early_exit"),
            "early_exit drafts with the target's first layers, which tensor and pipeline parallelism split",
        ),
    ],
)
def test_what_pipeline_parallelism_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        EngineArgs(**kwargs).create_config(ARCH, "model")
    assert "\n" not in str(error.value)


@pytest.mark.process
def test_the_command_refuses_more_stages_than_layers_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "generate", "x", "-pp", "31"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "pipeline_parallel_size 31 leaves a stage with no decoder layer" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
