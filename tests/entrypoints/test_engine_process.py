"""The engine in its own process: output deltas, the AsyncLLM round trip, failures and a dying engine."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM, EngineDeadError
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output_wire import OutputDecoder, OutputEncoder
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.spec_decode.metrics import SpecDecodeStats

# -- the wire format ---------------------------------------------------------------------------------


def _cumulative(step: int, finished: bool, text_rewrite: bool = False) -> RequestOutput:
    """Step `step` of a two-sample request: sample 0 grows one token per step (with log-probs),
    sample 1 two tokens; `text_rewrite` makes sample 1's text not extend its previous text."""
    completions = [
        CompletionOutput(
            0,
            "a" * step,
            list(range(step)),
            "length" if finished else None,
            logprobs=[{t: -0.5 * t} for t in range(step)],
            cumulative_logprob=-0.25 * step,
        ),
        CompletionOutput(
            1, ("z" if text_rewrite else "b") * (2 * step), [7] * (2 * step), "stop" if finished else None, 7
        ),
    ]
    metrics = RequestMetrics(1.0, 1.5, 2.0 if step else None, 9.0 if finished else None, step // 2)
    return RequestOutput(
        "r", "hello", [3, 4, 5], completions, finished, metrics, num_cached_tokens=16,
        spec_decode=SpecDecodeStats(step, 2 * step, step) if step else None,
    )  # fmt: skip


def test_deltas_rebuild_every_cumulative_output_and_send_only_what_is_new():
    encoder, decoder = OutputEncoder(), OutputDecoder()
    decoder.add_request("r", "hello", [3, 4, 5])
    received = []
    for step in range(1, 6):
        sent = _cumulative(step, finished=step == 5, text_rewrite=step == 4)
        delta = encoder.encode(sent)
        if step > 1:  # only the step's new token ids cross, not the whole list
            assert delta[5][0][1] == [step - 1] and delta[5][1][1] == [7, 7]
            assert len(delta[5][0][6]) == 1  # one new log-prob entry
        received.append(decoder.decode(delta))
        assert received[-1] == sent
    assert received[2].outputs[0].token_ids == [0, 1, 2]  # earlier outputs are snapshots, not views
    assert not decoder.has_request("r") and "r" not in encoder._sent  # a finished request is forgotten
    assert decoder.decode(encoder.encode(_cumulative(1, False))) is None  # unknown: dropped


# -- the engine process ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_args(tiny_model_dir) -> EngineArgs:
    return EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")


async def _collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str):
    last = None
    async for output in llm.generate(prompt, params, request_id):
        last = output
    return last


def test_async_llm_streams_the_offline_engines_outputs(engine_args):
    prompts = [[1, 5, 9, 14], [2, 30, 31, 32, 33, 34, 35], [7] * 40]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    offline = LLM(**vars(engine_args)).generate(prompts, params)
    llm = AsyncLLM(engine_args)
    try:

        async def run_all() -> list[RequestOutput]:
            jobs = [_collect(llm, p, params, f"r{i}") for i, p in enumerate(prompts)]
            return await asyncio.gather(*jobs)

        served = asyncio.run(run_all())
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
    assert llm.gauges.num_running == 0 and not llm.is_running


class _CrashingEngine(LLMEngine):
    def add_request(self, *args, **kwargs):
        raise AssertionError("a bug outside the step")


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
    """Its first step fails; the steps after it work."""

    failed = False

    def step(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("out of memory in the step")
        return super().step()


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine_args):
    llm = AsyncLLM(engine_args, engine_factory=_FailingStepEngine)
    try:
        params = SamplingParams(max_tokens=4)
        with pytest.raises(RuntimeError, match="out of memory in the step"):
            asyncio.run(asyncio.wait_for(_collect(llm, [1, 2, 3], params, "r"), timeout=60))
        assert llm.is_running
        after = asyncio.run(asyncio.wait_for(_collect(llm, [1, 2, 3], params, "r2"), timeout=60))
        assert after.finished and len(after.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_a_model_that_cannot_load_raises_in_the_server_process(tmp_path):
    with pytest.raises(ValueError, match="not-a-model"):
        AsyncLLM(EngineArgs(model=str(tmp_path / "not-a-model")))


_ORPHAN_SCRIPT = """
import os, sys
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM
llm = AsyncLLM(EngineArgs(model=sys.argv[1], dtype="float32", kv_cache_memory="16MiB"), fork=True)
with open(sys.argv[2], "w") as out:
    out.write(str(llm._process.pid))
os._exit(0)  # no shutdown, no atexit: as if the server were killed
"""


def test_a_forked_engine_process_exits_when_the_server_process_dies(tiny_model_dir, tmp_path):
    pid_file, log = tmp_path / "engine.pid", tmp_path / "server.log"
    with open(log, "w") as out:  # a file, not a pipe: an orphaned engine would hold a pipe open
        command = [sys.executable, "-c", _ORPHAN_SCRIPT, tiny_model_dir, str(pid_file)]
        assert subprocess.run(command, stdout=out, stderr=out, timeout=300).returncode == 0, log.read_text()
    engine_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while _is_alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _is_alive(engine_pid):
        os.kill(engine_pid, signal.SIGKILL)
        pytest.fail("the engine process outlived the server process")


def _is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


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
