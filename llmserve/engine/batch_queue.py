"""Pipeline parallelism's step: up to one batch per stage in the pipeline at once.

With one batch at a time, each stage would idle while the others run. Here a step first fills the
pipeline: it schedules a batch from the requests in no batch in flight, submits it (its plan to
every rank, stage 0's layers on rank 0, the activations sent on without waiting), and repeats until
`depth` batches are in flight or nothing else can be scheduled; each batch takes at most its share
of the requests free to run, so that requests arriving together still fill several batches. Then it
waits for the oldest
batch's logits from the last stage, and the engine samples, updates the scheduler and emits outputs
for it as for any step. At steady state stage 0 computes batch B while the later stages compute
A, and so on down the pipeline. Each request is in at most one batch in flight (the scheduler
leaves those out), so a request's next step is planned only once its previous one has come back.

`record` counts what overlapped, for tests and logs: no timing, only which batches were in
flight together.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.core.scheduler import Scheduler, SchedulerOutput
from llmserve.worker.model_runner import ModelRunnerOutput
from llmserve.worker.pipeline_stage import PipelineDriver, SubmittedBatch


@dataclass
class InFlightBatch:
    scheduled: SchedulerOutput
    submitted: SubmittedBatch
    start: float  # when it was scheduled (time.monotonic)

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset(self.scheduled.plan.num_scheduled_tokens)


@dataclass
class OverlapRecord:
    """What the queue has had in flight: the most batches at once, and for each wait on the oldest
    batch the sets of request ids then in flight (the last `keep` waits with two or more)."""

    max_in_flight: int = 0
    waits_with_overlap: int = 0  # waits for a batch while another was in flight behind it
    keep: int = 64
    overlaps: deque[tuple[frozenset[str], ...]] = field(default_factory=deque)

    def observe(self, in_flight: deque[InFlightBatch]) -> None:
        self.max_in_flight = max(self.max_in_flight, len(in_flight))
        if len(in_flight) < 2:
            return
        self.waits_with_overlap += 1
        self.overlaps.append(tuple(batch.request_ids for batch in in_flight))
        if len(self.overlaps) > self.keep:
            self.overlaps.popleft()


class BatchQueue:
    def __init__(self, scheduler: Scheduler, driver: PipelineDriver, depth: int) -> None:
        self.scheduler = scheduler
        self.driver = driver
        self.depth = depth  # batches in flight at most: one per stage
        self.in_flight: deque[InFlightBatch] = deque()
        self.record = OverlapRecord()

    def step(self) -> tuple[SchedulerOutput, ModelRunnerOutput, float] | None:
        """Fill the pipeline, then wait for its oldest batch: (its schedule, its sampled output, when
        it was scheduled); None when nothing was in flight or schedulable."""
        while len(self.in_flight) < self.depth and self._submit_next():
            pass
        if not self.in_flight:
            return None
        self.record.observe(self.in_flight)
        batch = self.in_flight.popleft()  # gone even if collecting fails: a failed pipeline stays failed
        return batch.scheduled, self.driver.collect(batch.submitted), batch.start

    def drain(self) -> None:
        """Take back every batch in flight and drop its results (shutting down); a failed pipeline
        has nothing to take back."""
        while self.in_flight:
            batch = self.in_flight.popleft()
            with contextlib.suppress(Exception):
                self.driver.collect(batch.submitted)

    def _submit_next(self) -> bool:
        busy = self._busy_request_ids()
        start = time.monotonic()
        scheduled = self.scheduler.schedule(busy, self._batch_share(busy))
        if scheduled.is_empty:
            return False
        overlap = busy & frozenset(scheduled.plan.num_scheduled_tokens)
        if overlap:  # the scheduler's contract; a breach would run a request twice
            raise RuntimeError(f"requests {sorted(overlap)} scheduled while already in flight")
        self.in_flight.append(InFlightBatch(scheduled, self.driver.submit(scheduled.plan), start))
        return True

    def _batch_share(self, busy: frozenset[str]) -> int:
        """Requests this batch takes at most: the free ones spread over the batches still to fill,
        so that requests arriving together still split into batches that overlap."""
        scheduler = self.scheduler
        free = sum(r.request_id not in busy for r in scheduler.running) + scheduler.num_waiting
        return max(1, -(-free // (self.depth - len(self.in_flight))))

    def _busy_request_ids(self) -> frozenset[str]:
        return frozenset().union(*(batch.request_ids for batch in self.in_flight))
