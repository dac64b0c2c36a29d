"""Iteration-level (continuous) batching under a per-step token budget.

There are no prefill and decode phases. Each request knows how many of its tokens have KV in the
cache (`num_computed_tokens`) and how many exist (`num_tokens`); each step the scheduler lets
requests catch up by some of the difference, running requests first (in admission order), then
waiting ones, until the token budget (`max_num_batched_tokens`) or the sequence cap
(`max_num_seqs`) is used up. A long prompt therefore becomes several chunks mixed with other
requests' decodes, a decode is "catch up by one", a prefix-cache hit starts a request with some
tokens already computed, and a resumed preempted request re-prefills its prompt and output (from
the prefix cache where its blocks survived). A request whose computed tokens reach its known
tokens gets a sampled token.

Speculative decoding (llmserve/spec_decode) extends "catch up": a decoding request with k drafts
catches up by 1 + k tokens under the same budget, receives 1..k+1 tokens back, and only the verified
ones count as computed; the slots of rejected drafts are rolled back. The drafts were proposed after
the previous step (core/draft_planner.py takes them); a proposer with a KV cache of its own writes it
right after this step, into lookahead slots reserved here past the step's tokens.

When the KV pool cannot hold a running request's next tokens, the least urgent running request
(FCFS: the most recently admitted) is preempted (its blocks freed, recomputed later) rather than
failing the step. Under the priority policy a waiting request that is more urgent than a running
one, and does not fit, preempts it too (see request_queue.py for the order and its aging rule).

Latency targets (core/latency_targets.py) shape each step: a step-time cost model fitted from the
measured steps (core/step_cost.py) sizes prompt chunks to what the running decodes' TPOT slack allows,
admits a prompt about to miss its TTFT target whatever that slack, orders waiting prompts by TTFT
deadline within each priority level. Tokens are never changed by it, only when they are computed.

Pipeline parallelism schedules while earlier batches are still in the pipeline
(engine/batch_queue.py): `schedule(in_flight)` leaves the requests of those batches out, neither
scheduling nor preempting them, so no request is in two batches at once and none loses its KV
while a stage still computes it; `update_from_output` takes each batch when its result is back.
"""

from __future__ import annotations

import time
from collections.abc import Set
from dataclasses import dataclass, field

from llmserve.config import SchedulerConfig
from llmserve.core.draft_planner import DraftPlanner
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_transfer import ExportPlanner
from llmserve.core.latency_targets import LatencyTargets, OutputLengths, StepBudget
from llmserve.core.plan_writer import PlanWriter
from llmserve.core.preemption import PreemptionCosts
from llmserve.core.request_queue import PriorityQueue, create_request_queue
from llmserve.core.step_cost import StepCostModel, StepShape
from llmserve.core.step_plan import StepPlan
from llmserve.outputs import SpecDecodeStats
from llmserve.request import DraftProposal, Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's schedule: the plan the model runner executes (by id, as deltas), and the
    scheduler's own record of it (its Request objects, for updating them and for the step's stats)."""

    plan: StepPlan = field(default_factory=StepPlan)
    requests: list[Request] = field(default_factory=list)  # the plan's, in its order
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended while planning (outgrew the pool)
    num_prompt_tokens: int = 0  # prompt tokens among the scheduled ones (drafts and outputs are not)
    shape: StepShape = StepShape()  # what the step computes, for the step-time cost model

    @property
    def is_empty(self) -> bool:
        plan = self.plan
        moves = plan.swap_out or plan.swap_in or plan.block_copies or plan.tier_ops
        return not (self.requests or self.finished or moves)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.plan.num_scheduled_tokens[request.request_id] = num_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        preemption_costs: PreemptionCosts | None = None,
        draft_planner: DraftPlanner | None = None,
        kv_exports: ExportPlanner | None = None,
    ) -> None:
        self.config = config
        self.kv_exports = kv_exports  # a prefill instance's exported blocks; None: exports nothing
        self.kv_cache = kv_cache_manager
        self.preemption_costs = preemption_costs
        self.draft_planner = draft_planner  # speculative decoding; None when off
        self.spec_decode_stats = SpecDecodeStats()
        self.waiting = create_request_queue(config.scheduling_policy, config.priority_aging_seconds)
        self.running: list[Request] = []  # admission order (FCFS) or most urgent first (priority)
        self.requests: dict[str, Request] = {}
        self.plan_writer = PlanWriter(kv_cache_manager)  # what the model runner holds of each request
        self.num_preemptions = 0
        self.preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.num_swapped_out_blocks = 0
        self._in_flight: Set[str] = frozenset()  # the current schedule() call's arguments
        self._batch_seqs = config.max_num_seqs
        self.targets = LatencyTargets.from_ms(config.ttft_target_ms, config.tpot_target_ms)
        self.cost_model = StepCostModel()  # fed by the engine with each step's measured time
        self._step_budget: StepBudget | None = None  # the current schedule() call's, once built
        self._budget_inputs: tuple | None = None  # what it is built from (None: no targets)
        self.output_lengths = OutputLengths()  # of finished requests: a TPOT target's horizon

    # -- queue management -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted) and free its blocks at once."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finished_time = time.monotonic()
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.output_lengths.add(request.num_output_tokens)
        self.kv_cache.free(request)
        self.kv_cache.forget(request)
        del self.requests[request.request_id]
        self.plan_writer.finished(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the step plan -------------------------------------------------------------------------

    def schedule(
        self, in_flight: Set[str] = frozenset(), max_batch_seqs: int | None = None
    ) -> SchedulerOutput:
        """The next batch; `in_flight`: ids of running requests in batches not yet updated from their
        output (pipeline parallelism), which this one neither schedules nor preempts;
        `max_batch_seqs`: requests in this batch at most (max_num_seqs still caps all running)."""
        output = SchedulerOutput()
        self._in_flight, self._batch_seqs = in_flight, max_batch_seqs or self.config.max_num_seqs
        if isinstance(self.waiting, PriorityQueue):
            self.running.sort(key=self.waiting.key)
            self._preempt_for_urgent_waiting(output)
        self._step_budget = self._budget_inputs = None
        if self.targets.ttft is not None or self.targets.tpot is not None:
            # built on first use: a step of decodes alone with nothing waiting never reads it
            self._budget_inputs = (
                list(self.running),
                list(self.waiting),
                isinstance(self.waiting, PriorityQueue),
                in_flight,
                time.monotonic(),
            )
        num_preempted_before = len(output.preempted)
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if len(output.preempted) == num_preempted_before:  # no KV pressure from running requests
            self._schedule_waiting(output, budget)
        plan = output.plan
        plan.speculate, plan.max_drafts = self._speculation(len(self.running))
        if plan.speculate:
            plan.draft_limits = self.draft_planner.draft_limits(output.requests)
        plan.block_copies = self.kv_cache.take_pending_copies()
        plan.tier_ops = self.kv_cache.take_tier_ops()
        if self.kv_exports is not None:
            plan.kv_exports = self.kv_exports.exports(output.requests, plan.num_scheduled_tokens)
        output.num_prompt_tokens, output.shape = self.plan_writer.write(plan, output.requests)
        now = time.monotonic()
        for request in output.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return output

    def _budget(self) -> StepBudget:
        """This step's latency budget, built the first time the step needs it."""
        if self._step_budget is None:
            running, waiting, by_priority, in_flight, now = self._budget_inputs
            self._step_budget = StepBudget(
                self.cost_model,
                self.targets,
                running,
                waiting,
                by_priority,
                in_flight,
                now,
                self.output_lengths.typical,
            )
        return self._step_budget

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The measured time of a step this scheduler planned, for the cost model."""
        if output.requests:
            self.cost_model.observe(output.shape, seconds)

    def reset_counters(self, step_costs: bool = False) -> None:
        """Forget what finished requests were counted in (speculative decoding totals, output lengths)
        and, with `step_costs`, every step the cost model observed (after the warm-up)."""
        self.spec_decode_stats = SpecDecodeStats()
        self.output_lengths = OutputLengths()
        if step_costs:
            self.cost_model = StepCostModel()

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        planner = self.draft_planner
        speculate, share = self._speculation(len(self.running))
        index = 0
        while index < len(self.running) and budget > 0 and len(output.requests) < self._batch_seqs:
            request = self.running[index]
            if request.request_id in self._in_flight:
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.first_token_time is None and self._budget_inputs is not None:  # a prompt's chunk
                num_new = self._budget().prompt_chunk(request, num_new, request.num_computed_tokens)
                if not num_new:  # the decodes' TPOT slack leaves it nothing this step
                    index += 1
                    continue
            num_drafts = (
                planner.plan_within(request, budget, share, self.config.max_model_len) if speculate else 0
            )
            samples = num_new == request.num_tokens - request.num_computed_tokens
            lookahead = planner.num_lookahead_tokens(request, share) if speculate and samples else 0
            while not self.kv_cache.allocate_slots(request, num_new + num_drafts + lookahead):
                if lookahead:  # the next step's draft KV is a bonus: never preempt for it
                    lookahead = 0
                    continue
                if num_drafts:  # no room for the drafts: decode without them rather than preempt
                    num_drafts = 0
                    request.clear_drafts()
                    continue
                victim = self._least_urgent_preemptible()  # `request` itself at worst
                if victim is request and len(self.running) == 1:
                    # Alone and still too big: the pool can never hold it, so it ends here.
                    self.finish_request(request, RequestStatus.FINISHED_LENGTH)
                    output.finished.append(request)
                    break
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                output.add(request, num_new + num_drafts)
                if num_drafts:
                    output.plan.spec_token_ids[request.request_id] = request.spec_token_ids
                    if request.spec_tree_parents is not None:  # a token tree (sample/token_tree.py)
                        output.plan.spec_tree_parents[request.request_id] = request.spec_tree_parents
                budget -= num_new + num_drafts
                index += 1
        return budget

    def _least_urgent_preemptible(self) -> Request | None:
        """The last running request that is in no batch in flight."""
        return next((r for r in reversed(self.running) if r.request_id not in self._in_flight), None)

    def _speculation(self, num_running: int) -> tuple[bool, int | None]:
        """Whether `num_running` requests speculate, and auto mode's drafts per request (None: no cap)."""
        planner = self.draft_planner
        return (False, None) if planner is None else planner.speculation(num_running)

    def _preempt_for_urgent_waiting(self, output: SchedulerOutput) -> None:
        """Priority policy: evict less urgent running requests while the most urgent waiting one
        cannot be admitted (no sequence slot or not enough blocks for its prompt)."""
        key = self.waiting.key
        while self.waiting and self.running:
            head, victim = self.waiting.peek(), self._least_urgent_preemptible()
            if victim is None or key(victim) <= key(head) or self._fits(head):
                return
            self._preempt(victim, output)

    def _fits(self, request: Request) -> bool:
        """Whether the request's whole prompt fits beside the running requests' next tokens."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        kv = self.kv_cache
        running_needs = sum(kv.num_missing_blocks(r) for r in self.running)
        needed = kv.num_missing_blocks(request, kv.get_computed_blocks(request))
        return running_needs + needed <= kv.pool.num_free_blocks

    def _lora_fits(self, request: Request) -> bool:
        """Whether admitting the request keeps the running requests' distinct LoRA adapters within
        max_loras (each step's adapters must all be resident)."""
        name, limit = request.sampling_params.lora_name, self.config.max_loras
        if name is None or limit is None:
            return True
        running = {r.sampling_params.lora_name for r in self.running} - {None}
        return name in running or len(running) < limit

    def _waiting_order(self) -> list[Request]:
        """The waiting requests in the order they are admitted: the queue's, or with latency targets
        by TTFT deadline within each priority level."""
        if self._budget_inputs is None:
            return list(self.waiting)
        return self._budget().waiting_order

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return
        for request in self._waiting_order():
            if not (
                budget > 0
                and len(self.running) < self.config.max_num_seqs
                and len(output.requests) < self._batch_seqs
            ):
                break
            if not self._lora_fits(request):
                continue  # its adapter would exceed --max-loras: later requests may share a running one
            if self.kv_cache.is_swapped(request):
                if not self._swap_in(request, output, budget):
                    break
                budget -= output.plan.num_scheduled_tokens[request.request_id]
                continue
            source = request.fork_source
            if source is not None and source.status == RequestStatus.RUNNING:
                if source.num_computed_tokens < request.num_prompt_tokens or not self._fork(
                    request, output, budget
                ):
                    break  # wait for the sibling computing the shared prompt, or for room
                budget -= output.plan.num_scheduled_tokens[request.request_id]
                continue
            cached_blocks = self.kv_cache.get_computed_blocks(request)
            if not self.kv_cache.tier_hit_ready(request, cached_blocks):
                continue  # its hit's blocks are being read from disk: the requests after it go first
            num_cached = self.kv_cache.num_cached_tokens(cached_blocks)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self._budget_inputs is not None and self.config.enable_chunked_prefill:
                num_new = self._budget().prompt_chunk(request, num_new, num_cached)
                if not num_new:
                    break  # the decodes' TPOT slack leaves no room; later prompts are less urgent
            if not self.kv_cache.allocate_slots(request, num_new, cached_blocks):
                break
            self.waiting.remove(request)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:  # a recompute's lookup is not counted again (as vLLM)
                request.num_cached_tokens = num_cached
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.add(request, num_new)
            budget -= num_new

    def _fork(self, request: Request, output: SchedulerOutput, budget: int) -> bool:
        """Admit a parallel sample on its sibling's prompt blocks; only the last prompt token (for
        its own logits) and any output of its own are computed."""
        shared = request.num_prompt_tokens - 1
        span = self.kv_cache.hit_multiple * self.kv_cache.block_size
        if (
            self.kv_cache.hit_multiple > 1
        ):  # int4/int2: whole spans only (their window stays with the sibling)
            shared -= shared % span
        self.kv_cache.fork(request.fork_source, request, shared)
        request.num_computed_tokens = shared
        num_new = min(request.num_tokens - shared, budget)
        if not self.kv_cache.allocate_slots(request, num_new):
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        output.add(request, num_new)
        return True

    def _swap_in(self, request: Request, output: SchedulerOutput, budget: int) -> bool:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        moves = self.kv_cache.swap_in(request, num_new)
        if moves is None:
            return False
        output.plan.swap_in.extend(moves)
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        output.add(request, num_new)
        return True

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Swap the request's KV to CPU, or drop it to re-prefill prompt + output later."""
        self.running.remove(request)
        request.clear_drafts()  # speculative decoding: drafts planned this step are void
        if self._should_swap(request):
            moves = self.kv_cache.swap_out(request)
            output.plan.swap_out.extend(moves)
            self.num_swapped_out_blocks += len(moves)
            self.preemptions_by_mode["swap"] += 1
        else:
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
            self.preemptions_by_mode["recompute"] += 1
        request.status = RequestStatus.PREEMPTED
        self.plan_writer.preempted(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
        output.preempted.append(request)

    def _should_swap(self, request: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv_cache.can_swap_out(request):
            return False
        if mode == "swap" or self.preemption_costs is None:
            return True
        return self.preemption_costs.prefer_swap(request.num_computed_tokens)

    # -- after the model ran -------------------------------------------------------------------

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        proposals: dict[str, DraftProposal | None] | None = None,
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a stop rule.

        A request gets one new token, or 1..k+1 after verifying k drafts (the accepted drafts, then the
        recovered or bonus token); stop rules apply to each in order and drop the ones after a stop.
        Speculative decoding: `proposals` are the drafts made after this step, for the next.

        Returns the requests that received new tokens this step (finished ones included).
        """
        now = time.monotonic()
        updated = []
        plan, proposals = output.plan, proposals or {}
        for request in output.requests:
            if request.is_finished:  # aborted while its batch was in the pipeline
                continue
            request.num_computed_tokens += plan.num_scheduled_tokens[request.request_id]
            token_ids = sampled_token_ids.get(request.request_id)
            if token_ids is None:
                self.kv_cache.cache_computed_blocks(request)
                continue  # a prefill chunk that has not reached the end of the known tokens
            request.draft_proposal = proposals.get(request.request_id)
            num_drafts = len(plan.spec_token_ids.get(request.request_id, ()))
            if num_drafts:
                self._roll_back_rejected(request, num_drafts, num_accepted=len(token_ids) - 1)
            status = self._append_tokens(request, token_ids)
            # Blocks are registered only now that the accepted drafts are in all_token_ids (their hashes).
            self.kv_cache.cache_computed_blocks(request)
            if request.first_token_time is None:
                request.first_token_time = now
            if status is not None:
                self.finish_request(request, status)
            updated.append(request)
        return updated

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Speculative decoding: the KV of drafts after the first rejection is not computed; blocks that
        held only those drafts go back to the pool."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.kv_cache.free_excess_blocks(request)
        request.clear_drafts()
        request.spec_decode_stats.observe(num_drafts, num_accepted)
        request.draft_acceptance.observe(num_drafts, num_accepted)  # adaptive K
        self.spec_decode_stats.observe(num_drafts, num_accepted)

    def _append_tokens(self, request: Request, token_ids: list[int]) -> RequestStatus | None:
        """Append tokens until one ends the request; returns that stop status, if any."""
        for token_id in token_ids:
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                # A stop before the last accepted draft: KV past the kept tokens does not matter.
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                return status
        return None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and (
            token_id in request.eos_token_ids or token_id in params.stop_token_ids
        ):
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
