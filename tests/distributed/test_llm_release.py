"""An `LLM` with tensor-parallel ranks releases them (the rank processes, the process group) when it is
shut down, leaves a `with` block, is deleted or is collected: the same process can then start the next
tensor-parallel engine, which a process group still joined would refuse."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch.distributed as dist

from llmserve import LLM, SamplingParams
from tests.distributed.conftest import ENGINE_KWARGS

pytestmark = pytest.mark.process

PROMPT = [5, 6, 7, 8] * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _start(model_dir: str) -> tuple[LLM, list[multiprocessing.Process], list[int]]:
    """A TP=2 engine, its rank processes and the tokens it generates for PROMPT."""
    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE_KWARGS)
    ranks = list(llm.engine.executor.launcher.processes)
    assert ranks and all(process.is_alive() for process in ranks)
    tokens = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) == GREEDY.max_tokens
    return llm, ranks, tokens


def _assert_released(ranks: list[multiprocessing.Process]) -> None:
    assert all(process.exitcode is not None for process in ranks)
    # a clean stop: the ranks left on the empty plan, not on a kill
    assert [process.exitcode for process in ranks] == [0] * len(ranks)
    assert not dist.is_initialized()
    assert not [child for child in multiprocessing.active_children() if child.name.startswith("llmserve-tp")]


@pytest.mark.parametrize("release", ["shutdown", "del", "gc"])
def test_released_ranks_let_the_next_engine_start(release, tiny_llama_dir):
    first, ranks, tokens = _start(tiny_llama_dir)
    if release == "shutdown":
        first.shutdown()
        first.shutdown()  # a second call does nothing
        with pytest.raises(RuntimeError, match="shut down"):
            first.generate(PROMPT, GREEDY, use_tqdm=False)
    elif release == "del":
        del first  # the last reference
    else:
        first.cycle = first  # only the cycle collector can free it now
        del first
        gc.collect()
    _assert_released(ranks)

    second, second_ranks, second_tokens = _start(tiny_llama_dir)
    assert second_tokens == tokens
    second.shutdown()
    _assert_released(second_ranks)


def test_a_with_block_releases_the_ranks(tiny_llama_dir):
    with LLM(tiny_llama_dir, tensor_parallel_size=2, **ENGINE_KWARGS) as llm:
        ranks = list(llm.engine.executor.launcher.processes)
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    _assert_released(ranks)
