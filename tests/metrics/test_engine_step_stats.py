"""The engine's per-step statistics add up to the scheduler's own totals: preemptions by mode and KV
blocks swapped out and back (tiny model, a KV pool too small for every request's growth)."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from tests.helpers import make_tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_step_stats_count_preemptions_by_mode_and_swapped_blocks(tiny_dir, mode):
    prompts = [[(7 * i + j) % 500 + 10 for j in range(40 + 30 * i)] for i in range(6)]
    num_blocks = sum(-(-(len(p) + 1) // 16) for p in prompts) + 1  # all admitted; growth won't fit
    llm = LLM(
        model=tiny_dir, dtype="float32", block_size=16, num_kv_blocks=num_blocks, prefix_caching=False,
        preemption_mode=mode,
    )  # fmt: skip
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    scheduler = engine.scheduler
    assert scheduler.preemptions_by_mode[mode] > 0
    assert sum(s.num_preemptions for s in steps) == scheduler.num_preemptions
    assert sum(s.num_preemptions_swap for s in steps) == scheduler.preemptions_by_mode["swap"]
    assert sum(s.num_swapped_out_blocks for s in steps) == scheduler.num_swapped_out_blocks
    assert sum(s.num_swapped_in_blocks for s in steps) == scheduler.num_swapped_out_blocks  # all came back
    if mode == "recompute":
        assert scheduler.num_swapped_out_blocks == 0
    # each step carries the engine's one step-time model as it stands after the step (admission and
    # the watchdog read it in the server)
    assert scheduler.cost_model.fitted and steps[-1].step_cost == scheduler.cost_model.coefficients
    assert steps[0].step_cost is None  # not fitted after one step
