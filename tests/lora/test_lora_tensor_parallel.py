"""LoRA adapters under tensor parallelism: each rank holds its shard of every adapter (B's rows of
its heads and units in column-parallel layers, A's columns of its inputs in row-parallel ones), and
a batch mixing adapters gives one process's tokens."""

from __future__ import annotations

import pytest

from llmserve import SamplingParams
from tests.distributed.conftest import UNEVEN_HEADS, assert_same_greedy, engine
from tests.helpers import make_tiny_llama_dir
from tests.lora.adapters import ADAPTERS, make_adapter

pytestmark = pytest.mark.process

PROMPTS = [[5, 6, 7, 8] * 6, list(range(1000, 1040)), [31, 4159, 2653, 17, 9000]]


def _greedy(name: str | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, lora_name=name)


def test_two_ranks_give_one_process_tokens_for_every_adapter(tmp_path):
    base = make_tiny_llama_dir(str(tmp_path / "base"), **UNEVEN_HEADS)  # 6 query, 3 KV heads: uneven
    modules = []
    for seed, name in enumerate(ADAPTERS):
        make_adapter(base, str(tmp_path / name), seed + 1, **ADAPTERS[name])
        modules.append(f"{name}={tmp_path / name}")
    names = [None, *ADAPTERS]
    prompts = [p for p in PROMPTS for _ in names]
    params = [_greedy(n) for _ in PROMPTS for n in names]
    options = dict(enable_lora=True, lora_modules=modules, max_loras=len(ADAPTERS))
    with engine(base, **options) as one:
        want = one.generate(prompts, params, use_tqdm=False)
    with engine(base, tensor_parallel_size=2, **options) as two:
        got = two.generate(prompts, params, use_tqdm=False)
        with pytest.raises(ValueError, match="not supported with tensor parallelism"):
            two.engine.add_lora("late", str(tmp_path / "qv"))
    for reference, output in zip(want, got, strict=True):
        assert_same_greedy(reference, output)
    first = {p.lora_name: tuple(o.outputs[0].token_ids) for o, p in zip(want, params, strict=True)}
    assert len(set(first.values())) == len(names)  # every adapter changes the tokens
