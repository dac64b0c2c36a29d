"""The synchronous engine: add requests at any time, call `step()` until they finish.

One step is three moves: the scheduler plans which requests catch up by how many tokens, the model
runner executes that plan and samples, and the results update the requests and become outputs. With
speculative decoding a proposer drafts for the next step in between (spec_decode/proposer.py).
Under pipeline parallelism the first two moves are engine/batch_queue.py's, which keeps several
batches in the pipeline and hands back the oldest once its logits are sampled.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Callable, Sequence

import torch

from llmserve.config import CacheConfig, DeviceMemory, EngineArgs, EngineConfig
from llmserve.config.kv_cache_dtype import LOW_BIT_WINDOW_BLOCKS, is_low_bit
from llmserve.config.parallel import split_sizes, stage_layer_ranges
from llmserve.core.draft_planner import DraftPlanner
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_transfer import ExportPlanner
from llmserve.core.preemption import PreemptionCosts
from llmserve.core.scheduler import Scheduler, SchedulerOutput
from llmserve.core.step_plan import StepPlan
from llmserve.distributed.pipeline import PipelineStage
from llmserve.engine.batch_queue import BatchQueue
from llmserve.engine.grammar_gate import GrammarGate
from llmserve.engine.invariants import InvariantChecker
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.step_stats import StepStatsRecorder
from llmserve.lora.manager import LoRAManager
from llmserve.metrics.stats import StepStats
from llmserve.model_loader import load_arch_config, load_tokenizer, load_weights, resolve_model_path
from llmserve.model_loader.weights import expected_shapes
from llmserve.outputs import RequestOutput, SpecDecodeStats
from llmserve.request import Request, RequestStatus
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.spec_decode.proposers.draft_model import load_draft_arch
from llmserve.spec_decode.registry import create_proposer
from llmserve.spec_decode.target_vocabulary import TargetVocabulary
from llmserve.structured.compiler import GrammarCompiler
from llmserve.worker.executor import TensorParallelExecutor
from llmserve.worker.gpu_memory import profile_device_memory
from llmserve.worker.memory_report import log_memory_report, measure_memory, weight_count
from llmserve.worker.model_loading import load_model
from llmserve.worker.model_runner import ModelRunner, ModelRunnerOutput, allocate_kv_pool_early
from llmserve.worker.pipeline_stage import PipelineDriver

logger = logging.getLogger("llmserve")

_IDLE_COMPILE_WAIT = 0.05  # seconds an engine with only compiling requests sleeps before looking again


class LLMEngine:
    def __init__(
        self, args: EngineArgs, prepare_structured_outputs: bool = False, apply_output_kinds: bool = True
    ) -> None:
        """`prepare_structured_outputs`: start xgrammar's import and the vocabulary table in the grammar
        compiler's thread now, beside the model's loading and the KV prefault (a server's warm-up waits
        for it); the loading imports nothing of transformers, whose lazy modules race an import in
        another thread. `apply_output_kinds`: outputs of each request's kind (this engine is the front
        end); False in the engine process, whose deltas the server turns into each request's kind."""
        start = time.monotonic()
        path = resolve_model_path(args.model)
        draft_arch = load_draft_arch(args)  # speculative decoding: its KV pool shares the memory
        self.config: EngineConfig = args.create_config(load_arch_config(path), path, draft_arch)
        arch = self.config.model.arch
        self.tokenizer = load_tokenizer(path, None if os.path.isdir(path) else arch.eos_token_ids)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or arch.eos_token_ids
        # structured outputs: grammars compile in threads; their requests wait in the gate meanwhile
        self.grammar_gate = GrammarGate(GrammarCompiler(self.tokenizer, arch.vocab_size, self.eos_token_ids))
        # beside the model's loading and the KV prefault
        self.structured_outputs_ready = (
            self.grammar_gate.compiler.prepare() if prepare_structured_outputs else None
        )
        # tensor parallelism: the workers load their shards while this process loads rank 0's
        self.executor = TensorParallelExecutor(self.config) if self.config.parallel.world_size > 1 else None
        if self.executor is not None:
            self.config = self.executor.config  # rank 0's device, where the launcher assigned it
        try:
            self.model_runner, target_vocabulary = self._load_model_runner(
                path, lambda memory: args.create_config(arch, path, draft_arch, memory)
            )
        except BaseException:
            self.shutdown()
            raise
        self.config = self.model_runner.config  # on a GPU: the pool sized from the measured memory
        # why a row's results may depend on the rest of its step, for /server_info; (): they do not
        self.batch_invariance = self.model_runner.batch_invariance
        model = self.model_runner.model
        cache = self.config.cache
        self.kv_cache_manager = KVCacheManager(
            cache.num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.num_swap_blocks,
            sliding_window=cache.sliding_window,
            attention_sinks=cache.attention_sinks,
            enable_kv_events=cache.kv_events is not None,
            group_windows=tuple(group.window for group in cache.kv_groups) or None,
            tiers=self.model_runner.kv_tier_store.spec if self.model_runner.kv_tier_store else None,
            window_blocks=LOW_BIT_WINDOW_BLOCKS if is_low_bit(cache.kv_cache_dtype) else 0,
        )
        self.kv_event_publisher = None  # the prefix cache's changes, for a router (--kv-events-config)
        if cache.kv_events is not None:
            from llmserve.engine.kv_event_publisher import KVEventPublisher

            self.kv_event_publisher = KVEventPublisher(cache.kv_events)
        spec = self.config.speculative
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.kv_cache_manager,
            preemption_costs(self.config, model),
            DraftPlanner(spec) if spec is not None else None,
            _export_planner(cache, self.kv_cache_manager),
        )
        # speculative decoding (a draft head under tensor parallelism reads rank 0's whole-vocabulary copy)
        self.proposer = create_proposer(
            self.config, model if target_vocabulary is None else target_vocabulary, self.model_runner
        )
        self.batch_queue = None  # pipeline parallelism: a batch per stage in flight
        if self.executor is not None and self.executor.pipeline is not None:
            driver = PipelineDriver(self.config, self.executor, self.model_runner)
            self.batch_queue = BatchQueue(self.scheduler, driver, self.config.parallel.pipeline_parallel_size)
        self.output_processor = OutputProcessor(self.tokenizer, apply_output_kinds)
        self.last_step: StepStats | None = None
        self.failed_requests: list[str] = []  # of the last step: their output processing raised
        self.failed_logits_requests: list[str] = []  # of the last step: a logits processor of theirs raised
        self.invariants = InvariantChecker(self.kv_cache_manager) if args.check_invariants else None
        self.step_stats = StepStatsRecorder(
            self.scheduler, self.kv_cache_manager, self.model_runner.kv_tier_store
        )
        self._publish_kv_events = True  # False while warming up: a router must not see the warm-up
        self._measure_step_costs = True  # False while the warm-up builds kernels
        torch.manual_seed(self.config.model.seed)
        self.startup_seconds = time.monotonic() - start
        log_startup(self.config, self.startup_seconds, self.kv_cache_manager.max_blocks_per_sequence)
        # the packed model (rank 0's shard), its KV pool left out; sent on to /server_info
        self.memory = measure_memory(model, path, (self.model_runner.kv_cache,))
        log_memory_report(self.memory, path)

    def _load_model_runner(
        self, path: str, resolve_config: Callable[[DeviceMemory], EngineConfig]
    ) -> tuple[ModelRunner, TargetVocabulary | None]:
        """Rank 0's shard and its runner; and, for a draft head under tensor parallelism, rank 0's copy
        of the whole vocabulary (the shard holds a block of it). On a GPU with no pool size given,
        the runner's config is `resolve_config` of the device's memory measured after loading."""
        group = None if self.executor is None else self.executor.group
        config = self.config.model
        early_kv_pool = allocate_kv_pool_early(self.config)  # its prefault runs while the weights load
        target_vocabulary = None
        spec = self.config.speculative
        if group is not None and spec is not None and spec.method == "draft_head":
            vocabulary = {"model.embed_tokens.weight", "lm_head.weight"}  # only these: no other float load
            others = frozenset(expected_shapes(config.arch)) - vocabulary
            target_vocabulary = TargetVocabulary(
                config.arch, load_weights(path, config.dtype, others), config.device
            )
        parallel = self.config.parallel
        stage = PipelineStage.of(
            config.arch.num_hidden_layers, parallel.pipeline_parallel_size, 0
        )  # rank 0's
        model = load_model(config, self.tokenizer, group, stage)
        config = self.config
        if config.cache.size_from_gpu_memory is not None:  # the pool: what the weights and a step leave
            config = resolve_config(profile_device_memory(config, model))
        runner = ModelRunner(config, model, early_kv_pool, self.grammar_gate.compiler)
        if self.executor is not None:
            self.executor.wait_until_ready()
        return runner, target_vocabulary

    # -- tensor-parallel ranks, for the engine's health and metrics --------------------------------

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died); None while it can."""
        return None if self.executor is None else self.executor.failure

    def check_ranks(self) -> str | None:
        """`failure`, after looking for a tensor-parallel worker that has exited."""
        return None if self.executor is None else self.executor.check_workers()

    def rank_sentinels(self) -> list[int]:
        """What becomes ready when a live tensor-parallel worker exits (none without TP or once failed)."""
        if self.executor is None or self.executor.failure is not None:
            return []
        return self.executor.sentinels()

    def rank_stats(self) -> tuple:
        """Each tensor-parallel rank's latest RankStats (metrics/ranks.py); () without TP."""
        return () if self.executor is None else self.executor.rank_stats()

    def shutdown(self) -> None:
        """Stop the tensor- or pipeline-parallel workers, the KV-event publisher and the KV-transfer
        receiver, where there are any."""
        queue = getattr(self, "batch_queue", None)
        if queue is not None:
            queue.drain()  # the last stage's answers to batches in flight, which it waits to send
        if self.executor is not None:
            self.executor.shutdown()
        publisher = getattr(self, "kv_event_publisher", None)  # None too when loading failed first
        if publisher is not None:
            publisher.shutdown()
        receiver = getattr(getattr(self, "model_runner", None), "kv_receiver", None)  # a gloo decode instance
        if receiver is not None:
            receiver.close()

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; raises ValueError (with the limits named) if it can never run."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else _token_ids(prompt)
        self.validate_prompt(prompt_ids)
        check_params(params, self.config)
        if params.structured_outputs is not None:  # offline: compile now, so a bad grammar raises here
            self.grammar_gate.compiler.compile(params.structured_outputs)
        self.add_tokenized_request(request_id, prompt_ids, params, arrival_time, priority, text)

    def add_tokenized_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt: str | None = None,
    ) -> None:
        """Queue a prompt already tokenized and validated (the server did both: engine_core.py)."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.lora_name is not None:
            _lora_of(self.model_runner).check_name(params.lora_name)
        compiling = self.grammar_gate.future(params)
        children = [
            self._make_request(
                request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_ids,
                params if params.n == 1 else params.child(index),
                arrival_time,
                priority,
            )
            for index in range(params.n)
        ]
        for child in children[1:]:
            child.fork_source = children[0]  # parallel samples share the prompt's KV blocks
        self.output_processor.add_request(request_id, prompt, children, params.output_kind)
        if compiling is not None:
            self.grammar_gate.hold(request_id, compiling, children)
            return
        for child in children:
            self.scheduler.add_request(child)

    def add_pooling_request(
        self, request_id: str, prompt_ids: list[int], arrival_time: float | None = None, priority: int = 0
    ) -> None:
        """Queue an embedding request (prompt validated): a prefill only; its one output, once the
        prompt is computed, carries the pooled vector and its KV blocks are freed at once."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.batch_queue is not None:
            raise ValueError("embeddings are not supported with pipeline parallelism")
        request = self._make_request(
            request_id, prompt_ids, SamplingParams(max_tokens=1), arrival_time, priority
        )
        request.pooling = True
        self.output_processor.add_request(request_id, None, [request], RequestOutputKind.DELTA)
        self.scheduler.add_request(request)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the scheduler; a failed compile ends its
        request (the server compiled the same grammar before sending it, so this is rare)."""
        outputs = []
        for request_id, children, error in self.grammar_gate.take_ready():
            if error is None:
                for child in children:
                    self.scheduler.add_request(child)
                continue
            logger.error("request %s: its grammar failed to compile: %s", request_id, error)
            for child in children:
                _end_held(child)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt(prompt_ids, self.config)

    def _make_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival_time, priority: int
    ) -> Request:
        lora = self.model_runner.lora
        lora_key = b"" if lora is None else lora.cache_key(params.lora_name)
        return Request(request_id, prompt_ids, params, arrival_time, priority, self.eos_token_ids, lora_key)

    # -- LoRA adapters (llmserve/lora, docs/lora.md) -----------------------------------------------

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter in `path` as `name` while the engine runs; ValueError if LoRA is off,
        the name is taken or the adapter is refused."""
        if self.executor is not None:  # the other ranks' adapters are fixed at start
            raise ValueError("loading LoRA adapters after start is not supported with tensor parallelism yet")
        _lora_of(self.model_runner).load(name, path)

    def lora_cache_keys(self) -> dict[str, bytes]:
        """Each loaded adapter's prefix-cache key (LoRAManager.cache_key) by name: /server_info gives
        them to a router, which hashes an adapter's prompts as this engine does."""
        lora = self.model_runner.lora
        return {} if lora is None else {name: lora.cache_key(name) for name in lora.adapters}

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name`; ValueError if it is unknown or unfinished requests use it."""
        if self.executor is not None:
            raise ValueError("unloading LoRA adapters is not supported with tensor parallelism yet")
        users = sum(r.sampling_params.lora_name == name for r in self.scheduler.requests.values())
        if users:
            raise ValueError(f"the LoRA adapter {name!r} is in use by {users} unfinished requests")
        _lora_of(self.model_runner).remove(name)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish every unfinished child of the request and free its blocks; returns its last output."""
        children = self.output_processor.children_of(request_id)
        held = self.grammar_gate.drop(request_id)  # one still compiling never reached the scheduler
        for child in children:
            if held:
                _end_held(child)
            else:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)  # None if it held no such request

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or (pipeline parallelism) a batch still to take back, if only of aborted ones."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.batch_queue and self.batch_queue.in_flight)
            or bool(self.grammar_gate.pending)
        )

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Speculative decoding totals since start-up (drafts proposed, accepted)."""
        return self.scheduler.spec_decode_stats

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled() if self.grammar_gate.pending else []
        if self.batch_queue is not None:
            done = self.batch_queue.step()
            if done is None:
                self.last_step = None
                self.grammar_gate.wait(_IDLE_COMPILE_WAIT)
                return failed
            return failed + self._process(*done)
        start = time.monotonic()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            self.last_step = None
            self.grammar_gate.wait(_IDLE_COMPILE_WAIT)  # nothing to run but compiles: no busy loop
            return failed
        try:
            result = self._execute(scheduled.plan)
        except Exception as error:
            if self.failure is not None:  # a dead rank: the engine itself can no longer step
                raise
            batch = {
                self.output_processor.child_index.get(r.request_id, (None,))[0] for r in scheduled.requests
            }
            raise BatchFailed(sorted(b for b in batch if b is not None)) from error
        return failed + self._process(scheduled, result, start)

    def fail_requests(self, request_ids: list[str]) -> None:
        """Abort requests the engine gave up on alone (their blocks are freed; no output follows)."""
        for request_id in request_ids:
            for child in self.output_processor.children_of(request_id):
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            self.output_processor.forget(request_id)

    def _fail_children(self, child_ids: list[str]) -> list[str]:
        """Fail the requests these child ids belong to (a finished child's new token is then ignored)."""
        parents = sorted(
            {
                self.output_processor.child_index[c][0]
                for c in child_ids
                if c in self.output_processor.child_index
            }
        )
        for parent_id in parents:
            logger.error(
                "request %s failed: its logits processor raised (the cause is logged above)", parent_id
            )
        self.fail_requests(parents)
        return parents

    def _process(
        self, scheduled: SchedulerOutput, result: ModelRunnerOutput, start: float
    ) -> list[RequestOutput]:
        """Update the requests from a step's sampled tokens and turn them into outputs."""
        outputs = self.output_processor.outputs_for(scheduled.finished)
        plan = scheduled.plan
        proposals = None
        if self.proposer is not None and plan.speculate and scheduled.requests:  # drafts for the next step
            proposals = self.proposer.propose(SampledBatch.from_step(plan, result))
            self.model_runner.keep_draft_probs(proposals)
        sampled = result.sampled_token_ids
        num_sampled = sum(map(len, sampled.values()))
        accepted = [len(sampled[r]) - 1 for r in plan.spec_token_ids]  # per request, not per token
        if result.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        # before their tokens count
        self.failed_logits_requests = self._fail_children(result.failed) if result.failed else []
        if scheduled.requests:
            updated = self.scheduler.update_from_output(scheduled, sampled, proposals)
            outputs += self.output_processor.process(updated, result.logprobs, self.scheduler.finish_request)
            self.failed_requests = self.output_processor.take_failed()
            self.fail_requests(self.failed_requests)
        if result.pooled:
            outputs += self._finish_pooled(result.pooled)
        seconds = time.monotonic() - start
        # a pipeline's batches overlap: their times are not step costs
        if self.batch_queue is None and self._measure_step_costs:
            self.scheduler.observe_step(scheduled, seconds)
        tier_store = self.model_runner.kv_tier_store
        if tier_store is not None and (unwritten := tier_store.take_unwritten()):
            self.kv_cache_manager.pool.tiers.writes_failed(unwritten)  # the disk tier stops filling
        self.last_step = self.step_stats.record(scheduled, accepted, num_sampled, seconds)
        if self.kv_event_publisher is not None and self._publish_kv_events:
            self.kv_event_publisher.publish(self.kv_cache_manager.take_events())
        if self.invariants is not None:
            self.invariants.check()
        return outputs

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> list[RequestOutput]:
        """Embedding requests whose prompt is computed: finished (blocks freed), one output each."""
        outputs = []
        for request_id, vector in pooled.items():
            children = self.output_processor.children_of(request_id)
            if not children:  # aborted meanwhile
                continue
            self.scheduler.finish_request(children[0], RequestStatus.FINISHED_STOPPED)
            (output,) = self.output_processor.outputs_for(children)
            output.embedding, output.outputs = vector, []
            outputs.append(output)
        return outputs

    def _execute(self, plan: StepPlan) -> ModelRunnerOutput:
        if self.executor is None:
            return self.model_runner.execute(plan)
        return self.executor.execute(self.model_runner, plan)

    # -- the warm-up (engine/warmup.py) -----------------------------------------------------------------

    def begin_warmup(self, measure_steps: bool) -> None:
        """The warm-up's requests follow, until `reset_after_warmup`: their KV events are held back
        from a router, and their step times reach the cost model only with `measure_steps` (a fresh
        engine's first steps build kernels); called again to change `measure_steps`."""
        self._publish_kv_events = False
        self._measure_step_costs = measure_steps

    def reset_after_warmup(self, keep_step_costs: bool) -> None:
        """Leave no trace of the warm-up a client, a router or metrics could see: no cached prefixes,
        no KV events, no counts, and the global seed set again (a seedless sampled request draws as
        without warm-up); the cost model keeps the measured steps only with `keep_step_costs`."""
        self.kv_cache_manager.reset_prefix_cache()
        self.kv_cache_manager.take_events()  # the warm-up's stored blocks and their clearing: held back
        self.scheduler.reset_counters(step_costs=not keep_step_costs)
        self.step_stats.restart()
        self.last_step = None
        self._publish_kv_events = self._measure_step_costs = True
        torch.manual_seed(self.config.model.seed)


def _export_planner(cache: CacheConfig, kv_cache: KVCacheManager) -> ExportPlanner | None:
    """A prefill instance's planner of the blocks it sends (--kv-transfer-config); None otherwise."""
    if cache.kv_transfer is None or not cache.kv_transfer.produces:
        return None
    return ExportPlanner(kv_cache.prefix_cache, kv_cache.get_block_table, cache.block_size)


def preemption_costs(config: EngineConfig, model) -> PreemptionCosts:
    """Per rank under tensor parallelism: its shard's FLOPs, its KV heads' bytes (ranks run at once);
    under pipeline parallelism rank 0's stage's FLOPs, the fullest stage's KV bytes."""
    model_config, parallel = config.model, config.parallel
    arch = model_config.arch
    return PreemptionCosts(
        flops_per_token=2.0 * weight_count(model),
        kv_bytes_per_token=arch.kv_bytes_per_token(
            model_config.dtype,
            config.cache.kv_cache_dtype,
            parallel.max_kv_heads_per_rank(arch.num_key_value_heads),
            parallel.max_layers_per_stage(arch.num_hidden_layers),
        ),
        device_type=model_config.device.type,
    )


def log_startup(config: EngineConfig, startup_seconds: float, max_blocks_per_sequence: int) -> None:
    """Say what loaded and how much the KV pool holds (sequences at max_model_len)."""
    cache, model = config.cache, config.model
    tokens = cache.num_blocks * cache.block_size
    kv_dtype = str(model.dtype) if cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype
    logger.info(
        "model %s (%s, %s) ready in %.2f s; KV cache (%s): %d blocks x %d tokens = %d tokens (%.1f MiB), "
        "max concurrency at max_model_len %d: %.2f sequences",
        model.path,
        model.dtype,
        model.device,
        startup_seconds,
        kv_dtype,
        cache.num_blocks,
        cache.block_size,
        tokens,
        cache.kv_cache_memory / 2**20,
        model.max_model_len,
        tokens / model.max_model_len,
    )
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        logger.info(
            "tensor parallel size %d: each rank holds its KV heads' share of the pool (%s KV heads)",
            parallel.tensor_parallel_size,
            "/".join(map(str, split_sizes(model.arch.num_key_value_heads, parallel.tensor_parallel_size))),
        )
    if parallel.pipeline_parallel_size > 1:
        layers = stage_layer_ranges(model.arch.num_hidden_layers, parallel.pipeline_parallel_size)
        logger.info(
            "pipeline parallel size %d: each stage holds its layers' share of the pool (%s layers), "
            "up to %d batches in flight",
            parallel.pipeline_parallel_size,
            "/".join(str(len(run)) for run in layers),
            parallel.pipeline_parallel_size,
        )
    if cache.kv_groups:
        logger.info(
            "KV-cache groups (window, layers): %s; a block holds %d layers of one group",
            ", ".join(f"({g.window}, {len(g.layers)})" for g in cache.kv_groups),
            max(len(g.layers) for g in cache.kv_groups),
        )
    if cache.sliding_window:
        logger.info(
            "sliding window: %d tokens + %d attention sinks; a sequence holds at most %d blocks",
            cache.sliding_window,
            cache.attention_sinks,
            max_blocks_per_sequence,
        )


class BatchFailed(RuntimeError):
    """The forward pass (or sampling) of a step raised: the requests of that batch fail, no others."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"the engine step of {len(request_ids)} requests failed")
        self.request_ids = request_ids


def _end_held(request: Request) -> None:
    """Abort a request the scheduler never had (held while its grammar compiled)."""
    request.status = RequestStatus.FINISHED_ABORTED
    request.finished_time = time.monotonic()


def _lora_of(runner: ModelRunner) -> LoRAManager:
    """The runner's LoRA adapters; ValueError where LoRA is off."""
    if runner.lora is None:
        raise ValueError("LoRA adapters need --enable-lora")
    return runner.lora


def check_params(params: SamplingParams, config: EngineConfig) -> None:
    """Raise ValueError for parameters this model cannot honour (token ids past its vocabulary)."""
    vocab_size = config.model.arch.vocab_size
    past = [token for token in params.logit_bias or {} if token >= vocab_size]
    if past:
        raise ValueError(f"logit_bias has token id {past[0]}, but the vocabulary has {vocab_size} tokens")
    past = [token for token in params.stop_token_ids if token >= vocab_size]
    if past:
        raise ValueError(f"stop_token_ids has token id {past[0]}, but the vocabulary has {vocab_size} tokens")
    if params.prompt_logprobs is not None and config.parallel.pipeline_parallel_size > 1:
        raise ValueError("prompt_logprobs is not supported with pipeline parallelism")


def _token_ids(prompt: Sequence[int]) -> list[int]:
    """Token ids as Python ints (numpy's or torch's integers too); anything else is a ValueError."""
    try:
        if any(isinstance(token, bool) for token in prompt):
            raise TypeError
        return [operator.index(token) for token in prompt]
    except TypeError:
        raise ValueError("a prompt is text or a sequence of integer token ids") from None


def check_prompt(prompt_ids: list[int], config: EngineConfig) -> None:
    """Raise ValueError (with the limit named) for a prompt the engine could never run."""
    max_len = config.model.max_model_len
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= max_len:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the maximum context length (max_model_len) "
            f"is {max_len}, which must leave room for at least one generated token"
        )
    cache = config.cache
    if len(prompt_ids) + 1 > cache.num_blocks * cache.block_size:  # the whole pool, one sequence
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the whole KV cache holds only "
            f"{cache.num_blocks * cache.block_size} tokens ({cache.num_blocks} blocks of "
            f"{cache.block_size}); raise kv_cache_memory"
        )
    vocab = config.model.arch.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
