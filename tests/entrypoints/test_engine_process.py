"""The engine in its own process: output deltas, the AsyncLLM round trip, failures and a dying engine."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys

import pytest

from llmserve import LLM, RequestOutputKind, SamplingParams
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM, EngineDeadError
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.messages import AddRequest, EngineOutput, FailureKind, RequestsFailed, StepOutputs
from llmserve.engine.output_kinds import OutputAccumulator
from llmserve.metrics.stats import EngineGauges, StepStats
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeStats
from tests.helpers import is_alive, wait_until

# -- the wire format and output kinds ---------------------------------------------------------------


def _delta(step: int, finished: bool) -> RequestOutput:
    """Step `step` of a two-sample request as the engine sends it: sample 0 gains one token (with its
    log-prob), sample 1 two tokens and no log-probs; each carries only its new part."""
    completions = [
        CompletionOutput(
            0,
            "a",
            [step - 1],
            "length" if finished else None,
            logprobs=[{step - 1: -0.5 * (step - 1)}],
            cumulative_logprob=-0.25 * step,
        ),
        CompletionOutput(1, "bb", [7, 7], "stop" if finished else None, 7),
    ]
    metrics = RequestMetrics(1.0, 1.5, 2.0, 9.0 if finished else None, step // 2)
    return RequestOutput(
        "r", None, [3, 4, 5], completions, finished, metrics, num_cached_tokens=16,
        spec_decode=SpecDecodeStats(step, 2 * step, step),
    )  # fmt: skip


def _expected_cumulative(step: int, finished: bool) -> list[CompletionOutput]:
    return [
        CompletionOutput(
            0,
            "a" * step,
            list(range(step)),
            "length" if finished else None,
            logprobs=[{t: -0.5 * t} for t in range(step)],
            cumulative_logprob=-0.25 * step,
        ),
        CompletionOutput(1, "b" * (2 * step), [7] * (2 * step), "stop" if finished else None, 7),
    ]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_each_output_kind_from_the_engines_deltas(kind):
    accumulator = OutputAccumulator()
    accumulator.add_request("r", kind)
    received = [accumulator.apply(_delta(step, finished=step == 5)) for step in range(1, 6)]
    if kind is RequestOutputKind.DELTA:  # passed through untouched
        assert received == [_delta(step, finished=step == 5) for step in range(1, 6)]
    elif kind is RequestOutputKind.FINAL_ONLY:
        assert received[:4] == [None] * 4
        assert received[4].outputs == _expected_cumulative(5, True) and received[4].finished
    else:
        for step, output in enumerate(received, start=1):
            assert output.outputs == _expected_cumulative(step, step == 5)
        assert received[1].outputs[0].token_ids == [0, 1]  # earlier outputs are snapshots, not views
    assert received[4].metrics.finished_time == 9.0 and received[4].num_cached_tokens == 16
    assert accumulator.apply(_delta(1, False)) == _delta(1, False)  # finished: forgotten, passed through


def test_engine_messages_survive_the_pipe():
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA)
    wire = EngineOutput.of(_delta(2, False))
    stats, gauges = StepStats(1, 0, 0.5, 1, 0, 1, 0, 0.01), EngineGauges(num_running=1)
    for message in (
        AddRequest("r", [1, 2, 3], params, 12.5, priority=-1),
        StepOutputs([wire], stats, gauges),
        RequestsFailed(["r"], FailureKind.STEP, "boom"),
    ):
        assert pickle.loads(pickle.dumps(message)) == message
    assert wire.to_request_output(None, [3, 4, 5]) == _delta(2, False)


# -- the engine process ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_args(tiny_model_dir) -> EngineArgs:
    return EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")


async def _collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str):
    last = None
    async for output in llm.generate(prompt, params, request_id):
        last = output
    return last


async def _joined_deltas(llm: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str):
    """A DELTA stream's outputs concatenated: (token ids, text, log-prob entries, outputs received)."""
    token_ids, text, logprobs, count = [], "", [], 0
    async for output in llm.generate(prompt, params.with_output_kind(RequestOutputKind.DELTA), request_id):
        count += 1
        for completion in output.outputs:
            token_ids += completion.token_ids
            text += completion.text
            logprobs += completion.logprobs or []
    return token_ids, text, logprobs, count


@pytest.mark.process
def test_async_llm_streams_the_offline_engines_outputs(engine_args):
    prompts = [[1, 5, 9, 14], [2, 30, 31, 32, 33, 34, 35], [7] * 40]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    offline = LLM(**vars(engine_args)).generate(prompts, params)
    llm = AsyncLLM(engine_args)
    try:

        async def run_all() -> list[RequestOutput]:
            jobs = [_collect(llm, p, params, f"r{i}") for i, p in enumerate(prompts)]
            return await asyncio.gather(*jobs)

        async def run_all_as_deltas() -> list[tuple]:
            jobs = [_joined_deltas(llm, p, params, f"d{i}") for i, p in enumerate(prompts)]
            return await asyncio.gather(*jobs)

        served = asyncio.run(run_all())
        streamed = asyncio.run(run_all_as_deltas())
        with pytest.raises(ValueError, match="prompt token ids"):  # checked here, before it is queued
            llm.encode_prompt([10**9])
    finally:
        llm.shutdown()
    for got, want in zip(served, offline, strict=True):
        assert got.finished and got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        for got_entry, want_entry in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert got_entry.keys() == want_entry.keys()
            assert list(got_entry.values()) == pytest.approx(list(want_entry.values()), abs=1e-4)
    for (token_ids, text, logprobs, count), want in zip(streamed, offline, strict=True):
        assert token_ids == want.outputs[0].token_ids and text == want.outputs[0].text
        assert [entry.keys() for entry in logprobs] == [entry.keys() for entry in want.outputs[0].logprobs]
        assert count > 1  # one output per step, not one at the end
    assert llm.gauges.num_running == 0 and not llm.is_running


def test_the_engine_process_applies_no_output_kind_and_a_front_end_engine_applies_each_once(engine_args):
    """Built as the engine process builds it, the engine's outputs are deltas whatever a request asked
    (the server applies the kind); built as the offline front end, they are of each request's kind."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def token_ids(engine: LLMEngine, kind: RequestOutputKind, abort_after: int | None = None) -> list:
        engine.add_tokenized_request("r", [1, 5, 9, 14], params.with_output_kind(kind))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
            if len(outputs) == abort_after:
                outputs.append(engine.abort_request("r"))
        return [list(output.outputs[0].token_ids) if output.outputs else [] for output in outputs]

    core = LLMEngine(engine_args, apply_output_kinds=False)
    deltas = token_ids(core, RequestOutputKind.CUMULATIVE)
    assert [len(delta) for delta in deltas] == [1, 1, 1, 1]
    assert token_ids(core, RequestOutputKind.FINAL_ONLY) == deltas
    assert token_ids(core, RequestOutputKind.CUMULATIVE, abort_after=2) == [*deltas[:2], []]  # abort: a delta
    assert core.output_processor.output_kinds is None
    front = LLMEngine(engine_args)
    everything = [token for delta in deltas for token in delta]
    assert token_ids(front, RequestOutputKind.CUMULATIVE) == [everything[:n] for n in range(1, 5)]
    assert token_ids(front, RequestOutputKind.DELTA) == deltas
    assert token_ids(front, RequestOutputKind.FINAL_ONLY) == [everything]
    aborted = [everything[:1], everything[:2], everything[:2]]  # the abort's output: everything so far
    assert token_ids(front, RequestOutputKind.CUMULATIVE, abort_after=2) == aborted
    assert token_ids(front, RequestOutputKind.FINAL_ONLY, abort_after=0) == [everything[:1]]  # its one output
    assert not front.output_processor.output_kinds._kinds  # every request forgotten at its end


class _CrashingEngine(LLMEngine):
    def add_tokenized_request(self, *args, **kwargs):
        raise AssertionError("a bug outside the step")


@pytest.mark.process
def test_a_dying_engine_process_fails_every_stream_instead_of_hanging(engine_args):
    llm = AsyncLLM(engine_args, engine_factory=_CrashingEngine)
    try:
        params = SamplingParams(max_tokens=4)
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            asyncio.run(asyncio.wait_for(_collect(llm, [1, 2, 3], params, "r"), timeout=60))
        assert not llm.is_running
    finally:
        llm.shutdown()


class _FailingStepEngine(LLMEngine):
    """Its first step with request "r" fails (the warm-up's steps before it work); the steps after it work."""

    failed = False

    def step(self):
        if not self.failed and self.output_processor.has_request("r"):
            self.failed = True
            raise RuntimeError("out of memory in the step")
        return super().step()


@pytest.mark.process
def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine_args):
    # without warm-up, whose first step would take the failure
    llm = AsyncLLM(engine_args, engine_factory=_FailingStepEngine, warmup=False)
    try:
        params = SamplingParams(max_tokens=4)
        with pytest.raises(RuntimeError, match="the engine step running this request failed"):
            asyncio.run(asyncio.wait_for(_collect(llm, [1, 2, 3], params, "r"), timeout=60))
        assert llm.is_running
        after = asyncio.run(asyncio.wait_for(_collect(llm, [1, 2, 3], params, "r2"), timeout=60))
        assert after.finished and len(after.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.mark.process
def test_a_model_that_cannot_load_raises_in_the_server_process(tmp_path):
    with pytest.raises(ValueError, match="not-a-model"):
        AsyncLLM(EngineArgs(model=str(tmp_path / "not-a-model")))


_ORPHAN_SCRIPT = """
import os, sys
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM
llm = AsyncLLM(EngineArgs(model=sys.argv[1], dtype="float32", kv_cache_memory="16MiB"), fork=True)
with open(sys.argv[2], "w") as out:
    out.write(str(llm.engine_core.pid))
os._exit(0)  # no shutdown, no atexit: as if the server were killed
"""


@pytest.mark.process
def test_a_forked_engine_process_exits_when_the_server_process_dies(tiny_model_dir, tmp_path):
    pid_file, log = tmp_path / "engine.pid", tmp_path / "server.log"
    with open(log, "w") as out:  # a file, not a pipe: an orphaned engine would hold a pipe open
        command = [sys.executable, "-c", _ORPHAN_SCRIPT, tiny_model_dir, str(pid_file)]
        assert subprocess.run(command, stdout=out, stderr=out, timeout=300).returncode == 0, log.read_text()
    engine_pid = int(pid_file.read_text())
    try:
        wait_until(lambda: not is_alive(engine_pid), 30, "the engine process to exit with the server process")
    finally:
        if is_alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


@pytest.mark.process
def test_a_spawned_engine_process_logs_at_the_servers_level(engine_args, capfd):
    """A spawned engine process starts with no logging set up: it gets the server's level."""
    import logging

    llmserve_logger = logging.getLogger("llmserve")
    level = llmserve_logger.level
    llmserve_logger.setLevel(logging.INFO)
    try:
        llm = AsyncLLM(engine_args)  # spawn: the default outside the server
        llm.shutdown()
    finally:
        llmserve_logger.setLevel(level)
    assert "ready in" in capfd.readouterr().err  # the engine's start-up line, from the child


def test_the_engine_process_exempts_its_start_up_objects_from_the_cyclic_collector():
    """What a serving engine process holds for its lifetime is frozen once it is ready, so a full
    collection during serving walks only the requests' objects."""
    import gc

    from llmserve.engine.engine_core import freeze_startup_objects

    model = [[] for _ in range(100)]  # stands in for what start-up leaves
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert all(o is not model for o in gc.get_objects())  # the collector no longer walks it
    finally:
        gc.unfreeze()
