"""How a model splits over tensor-parallel ranks, and what tensor parallelism refuses (no ranks started)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from llmserve.config import EngineArgs, ModelArchConfig
from llmserve.config.parallel import ParallelConfig, split_sizes
from llmserve.distributed.shard import ShardLayout
from llmserve.evaluation.perplexity import evaluate_perplexity

# the default model's shape (SmolLM2-135M): 9 query heads over 3 KV heads
ARCH = ModelArchConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def test_two_ranks_split_the_default_model_by_kv_head_group_unevenly():
    first, second = (ShardLayout.of(ARCH, 2, rank) for rank in range(2))
    assert (first.kv_heads, second.kv_heads) == (range(0, 2), range(2, 3))
    assert (first.q_heads, second.q_heads) == (range(0, 6), range(6, 9))
    assert (first.intermediate, second.intermediate) == (range(0, 768), range(768, 1536))
    assert (first.vocab, second.vocab, first.vocab_rows) == (range(0, 24576), range(24576, 49152), 24576)


def test_vocabulary_blocks_are_equal_and_the_last_one_is_padded():
    arch = ModelArchConfig(**{**ARCH.__dict__, "vocab_size": 97, "intermediate_size": 128})
    layouts = [ShardLayout.of(arch, 3, rank) for rank in range(3)]
    assert [layout.vocab for layout in layouts] == [range(0, 33), range(33, 66), range(66, 97)]
    assert {layout.vocab_rows for layout in layouts} == {33}
    assert [len(layout.intermediate) for layout in layouts] == [43, 43, 42]


def test_split_sizes_gives_the_first_ranks_the_remainder():
    assert split_sizes(9, 2) == [5, 4]
    assert split_sizes(3, 3) == [1, 1, 1]
    assert split_sizes(128, 3) == [43, 43, 42]


def test_a_split_leaving_a_rank_without_a_kv_head_is_a_one_line_error():
    with pytest.raises(ValueError, match="tensor_parallel_size 4 leaves a rank with no KV head") as error:
        EngineArgs(tensor_parallel_size=4).create_config(ARCH, "model")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="no KV head"):
        ShardLayout.of(ARCH, 4, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
        (dict(distributed_executor_backend="gpu"), "distributed_executor_backend must be one of mp, ray"),
        (dict(distributed_timeout_seconds=0), "distributed_timeout_seconds must be > 0"),
        (dict(tensor_parallel_size=2, speculative_method="early_exit"), "use draft_head, draft or ngram"),
    ],
)
def test_what_tensor_parallelism_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_config(ARCH, "model")


def test_each_rank_pools_its_own_kv_heads_so_capacity_grows_with_the_ranks():
    one_head_block = 2 * 30 * 64 * 4 * 32  # K and V, 30 layers, head_dim 64, float32, 32 tokens
    blocks = {
        tp: EngineArgs(
            tensor_parallel_size=tp, kv_cache_memory=60 * one_head_block, dtype="float32", device="cpu"
        )
        .create_config(ARCH, "model")
        .cache.num_blocks
        for tp in (1, 2, 3)
    }
    # per rank: 3 KV heads alone, 2 (the fuller rank of 2 + 1), 1
    assert blocks == {1: 20, 2: 30, 3: 60}
    assert EngineArgs(tensor_parallel_size=2).create_config(ARCH, "model").parallel.tensor_parallel_size == 2


def _llmserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["generate", "x", "--tensor-parallel-size", "4"],
            "tensor_parallel_size 4 leaves a rank with no KV head",
        ),
        (["train-draft-head", "--output", "h", "--tensor-parallel-size", "2"], "does not run under tensor"),
    ],
)
def test_the_command_refuses_in_one_line(args, message):
    result = _llmserve(*args)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_perplexity_evaluation_refuses_tensor_parallelism():
    engine = SimpleNamespace(config=SimpleNamespace(parallel=ParallelConfig(tensor_parallel_size=2)))
    with pytest.raises(ValueError, match="perplexity evaluation does not run under tensor parallelism"):
        evaluate_perplexity(engine, [1, 2, 3], context=2, decode_tokens=1)
