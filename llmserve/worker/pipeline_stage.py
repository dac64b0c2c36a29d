"""A pipeline stage's step: its layers on a batch, activations in from the stage before and out to
the stage after (distributed/pipeline.py says what crosses).

Rank 0 (`PipelineDriver`) submits a batch (its plan to every rank, stage 0's layers, the hidden
states to stage 1) without waiting for it, and later collects it (the logits from the last stage,
sampled here). Workers (`serve_stage`) take plans in the order rank 0 sent them; every stage runs
the batches in that order, so a later batch reads KV an earlier one wrote at every stage, as in one
process. Only a batch with tokens crosses the stages; its last stage answers rank 0 with the
sampling rows' logits (and, for a draft head, their hidden states), or a one-element
acknowledgement when it has none (a prompt chunk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from llmserve.config import EngineConfig
from llmserve.core.step_plan import StepPlan
from llmserve.distributed.pipeline import PendingSend, PipelineGroup
from llmserve.metrics.ranks import RankMeter, ReportSink
from llmserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from llmserve.worker.step_inputs import StepInputs

if TYPE_CHECKING:  # the executor starts the workers whose loop is here
    from llmserve.worker.executor import TensorParallelExecutor


def _acknowledgement(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


@dataclass
class SubmittedBatch:
    """A batch rank 0 has sent into the pipeline: its inputs (None without tokens) for sampling,
    and the sends still going."""

    inputs: StepInputs | None
    sends: list[PendingSend] = field(default_factory=list)


class PipelineDriver:
    """Rank 0's side of pipeline parallelism: it is stage 0 (with its tensor-parallel peers)."""

    def __init__(self, config: EngineConfig, executor: TensorParallelExecutor, runner: ModelRunner) -> None:
        assert executor.pipeline is not None, "the executor runs no pipeline"
        self.executor = executor
        self.pipeline: PipelineGroup = executor.pipeline
        self.runner = runner
        self.vocab_size = config.model.arch.vocab_size
        self.hidden_size, self.dtype = config.model.arch.hidden_size, config.model.dtype
        self.returns_hidden = returns_hidden(config)
        self._encoder = msgspec.msgpack.Encoder()

    def submit(self, plan: StepPlan) -> SubmittedBatch:
        """Send the plan to every rank and run stage 0's layers; returns without waiting for the
        other stages."""
        with self.executor.step_guard():
            batch = SubmittedBatch(None, self.pipeline.send_plan(self._encoder.encode(plan)))
            start = time.perf_counter()
            batch.inputs = self.runner.prepare(plan)
            if batch.inputs is not None:
                batch.sends.append(self.pipeline.send_activations(self.runner.run_stage(batch.inputs)))
        self.executor.record_step(self.runner, time.perf_counter() - start)
        return batch

    def collect(self, batch: SubmittedBatch) -> ModelRunnerOutput:
        """Wait for the batch's answer from the last stage and sample its rows here."""
        with self.executor.step_guard():
            inputs, logits, sample_hidden = batch.inputs, None, None
            if inputs is not None and inputs.sample_rows:
                rows, device = len(inputs.logits_indices), self.runner.device
                logits = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=device)
                self.pipeline.recv_result(logits)
                if self.returns_hidden:
                    sample_hidden = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=device)
                    self.pipeline.recv_result(sample_hidden)
            elif inputs is not None:
                self.pipeline.recv_result(_acknowledgement(self.runner.device))
            for send in batch.sends:
                send.wait()
            if logits is None:
                return ModelRunnerOutput({}, {})
            with torch.inference_mode():
                return self.runner.sample(logits, inputs, sample_hidden)


def returns_hidden(config: EngineConfig) -> bool:
    """Whether the last stage sends rank 0 the sampling rows' hidden states too (a draft head drafts
    from them)."""
    return config.speculative is not None and config.speculative.method == "draft_head"


def serve_stage(
    runner: ModelRunner, pipeline: PipelineGroup, config: EngineConfig, status: ReportSink | None = None
) -> None:
    """A worker's loop: run rank 0's plans on this stage until the empty plan, reporting to `status`
    now and then."""
    decoder = msgspec.msgpack.Decoder(StepPlan)
    meter = RankMeter(pipeline.rank, runner)
    sending: list[PendingSend] = []
    while data := pipeline.recv_plan():
        start = time.perf_counter()
        inputs = runner.prepare(decoder.decode(data))
        if inputs is not None:
            sending += _run_batch(runner, pipeline, config, inputs)
        sending = [send for send in sending if not send.is_done]
        meter.add_step(time.perf_counter() - start)  # with the wait for the previous stage's activations
        if status is not None and meter.report_due():
            status.send(meter.snapshot())
    for send in sending:
        send.wait()


def _run_batch(
    runner: ModelRunner, pipeline: PipelineGroup, config: EngineConfig, inputs: StepInputs
) -> list[PendingSend]:
    """This stage's layers on one batch; the sends of its output onward, if this rank sends any."""
    hidden = None
    if pipeline.stage > 0:
        shape = (len(inputs.input_ids), config.model.arch.hidden_size)
        hidden = pipeline.recv_activations(torch.empty(shape, dtype=config.model.dtype, device=runner.device))
    output = runner.run_stage(inputs, hidden)
    if not pipeline.is_last_stage:
        return [pipeline.send_activations(output)]
    logits = runner.stage_logits(output, inputs)
    if not pipeline.tp.is_first_rank:  # the stage's first rank gathered the logits
        return []
    if logits is None:
        return [pipeline.send_result(_acknowledgement(runner.device))]
    sends = [pipeline.send_result(logits)]
    if returns_hidden(config):
        sends.append(pipeline.send_result(output))
    return sends
