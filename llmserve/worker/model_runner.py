"""Runs one engine step on the device: flat inputs from the scheduler's plan, forward, sample.

The runner holds each request it runs (worker/request_state.py), updated from the step plan's deltas
(core/step_plan.py): it never reads the scheduler's objects. The KV pool is one preallocated tensor
[layers, 2, num_slots, kv_heads, head_dim]; each attention layer gets views of its K and V slices.
With KV-cache groups (config/kv_groups.py: sliding and global layers) it is [group_size, 2, ...]: the
j-th layer of every group uses the j-th tensor, and each group gets its own attention metadata.
The step's flat inputs are built by worker/step_inputs.py; on a one-rank CUDA engine decode steps
instead run on static buffers, replayed as CUDA graphs (worker/cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from llmserve.attention.kv_format import get_kv_cache_format
from llmserve.attention.registry import get_attention_backend, select_attention_backend
from llmserve.config import EngineConfig
from llmserve.config.kv_groups import group_size, stage_layers
from llmserve.core.step_plan import StepPlan
from llmserve.forward_context import set_forward_context
from llmserve.lora.manager import LoRAManager
from llmserve.models.decode_stack import build_decode_stack
from llmserve.outputs import PromptLogprobs
from llmserve.request import DraftProposal
from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.sampler import Sampler, SamplerOutput
from llmserve.sample.tree_verifier import TreeVerifier
from llmserve.sample.verifier import DraftVerifier
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import GrammarState
from llmserve.worker.batch_invariance import make_batch_invariant
from llmserve.worker.batch_invariance import on_by_default as batch_invariance_by_default
from llmserve.worker.batch_invariance import reasons as batch_invariance_reasons
from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.kv_tier_store import KVTierStore
from llmserve.worker.kv_transfer import create_connector, create_receiver
from llmserve.worker.prefault import PrefaultThread, populate_in_background
from llmserve.worker.prompt_logprobs import compute as compute_prompt_logprobs
from llmserve.worker.recent_kv import RecentKV
from llmserve.worker.request_state import CachedRequestState, apply_plan
from llmserve.worker.step_inputs import InputBuilder, StepInputs
from llmserve.worker.token_tree_kv import move_accepted_kv, tree_hidden_rows


@dataclass
class ModelRunnerOutput:
    # request id -> new tokens, for requests that caught up: one, or 1..k+1 after verifying k drafts
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]]  # request id -> per new token: top-N and its own log-probs
    # For drafting the next step (spec_decode/proposer.py): the requests that sampled, in row order, and
    # the final hidden state of each of their logits rows (k + 1 rows for a request verifying k drafts)
    sampled_requests: list[CachedRequestState] = field(default_factory=list)
    sample_hidden: torch.Tensor | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # requests that asked
    pooled: dict[str, list[float]] = field(default_factory=dict)  # embedding requests whose prompt is done
    failed: list[str] = field(default_factory=list)  # requests whose logits processor raised: they fail
    # token trees: request id -> the accepted drafts' indices, root to leaf (sample/tree_verifier.py)
    tree_paths: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EarlyKVPool:
    """A KV pool allocated before the model loads, with its prefault already running."""

    tensor: torch.Tensor
    prefault: PrefaultThread | None


def allocate_kv_pool_early(config: EngineConfig) -> EarlyKVPool | None:
    """The CPU KV pool of a one-rank engine, allocated and prefaulting before the model loads: its
    prefault then runs beside the weights' loading, which leaves a core idle. `ModelRunner` takes it
    where its shape is the one it needs (else it allocates its own). None elsewhere."""
    model, cache, arch = config.model, config.cache, config.model.arch
    if model.device.type != "cpu" or config.parallel.world_size > 1:
        return None
    kv_format = get_kv_cache_format(cache.kv_cache_dtype)
    pool = torch.empty(
        group_size(cache.kv_groups) if cache.kv_groups else arch.num_hidden_layers,  # the pool's tensors
        2,
        cache.num_blocks * cache.block_size,
        arch.num_key_value_heads,
        kv_format.row_size(arch.head_dim),
        dtype=kv_format.storage_dtype(model.dtype),
    )
    return EarlyKVPool(pool, _prefault(pool))


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        early_kv_pool: EarlyKVPool | None = None,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        """`grammar_compiler`: structured outputs' compiler, on the rank that samples (None elsewhere:
        a request with a grammar then cannot sample here)."""
        self.config = config
        self.model = model
        self.requests: dict[str, CachedRequestState] = {}  # every unfinished request the plans named
        self.device = config.model.device
        self.block_size = config.cache.block_size
        self.kv_groups = config.cache.kv_groups  # (): one group of every layer
        self.vocab_size = config.model.arch.vocab_size
        self.sampler = Sampler()
        self.grammar_compiler = grammar_compiler
        # Speculative decoding: the verifier checks the drafts a proposer made after the previous step.
        self.verifier = DraftVerifier(self.vocab_size, self.device)
        self.attention_backend = select_attention_backend(
            config.model.attention_backend,
            self.device,
            config.cache.kv_cache_dtype,
            reference_only=getattr(model, "reference_attention_only", False),
        )
        # LoRA adapters: deltas added by hooks on the linear layers; the fused stack adds them itself
        # where it can (bind_lora below), CUDA graphs are not captured (docs/lora.md)
        self.lora = (
            None if config.lora is None else LoRAManager(config.lora, model, config.model.dtype, self.device)
        )
        # --deterministic, unset: on where it changes attention alone (worker/batch_invariance.py); the
        # config read from here on (the engine's, the KV tiers' fingerprint) holds the decision
        if config.model.deterministic is None:
            decided = batch_invariance_by_default(config, model, self.attention_backend, self.lora)
            model_config = dataclasses.replace(config.model, deterministic=decided)
            config = self.config = dataclasses.replace(config, model=model_config)
        if config.model.deterministic:  # before the fused stack, which takes the layers' kernels
            make_batch_invariant(model, self.attention_backend)
        self.input_builder = InputBuilder(config.cache, self.attention_backend, self.device)
        # token trees: verified in the paged kernel where it takes tree masks, else on the torch reference
        self.tree_verifier = TreeVerifier(self.vocab_size, self.device)
        self.tree_input_builder = self.input_builder
        if self.attention_backend.name != "torch":
            reference = get_attention_backend("torch", config.cache.kv_cache_dtype)
            self.tree_input_builder = InputBuilder(config.cache, reference, self.device)
        # why a row's results may depend on the rest of its step (/server_info); (): they do not
        self.batch_invariance = batch_invariance_reasons(config, model, self.attention_backend, self.lora)
        self._early_kv_pool = early_kv_pool
        self._static_decode = self._uses_static_decode()  # decided first: its padding needs a scratch block
        self.kv_cache = self._allocate_kv_cache()
        self._early_kv_pool = None
        self.recent_kv = None  # int4/int2 caches: the windows and sinks kept in full precision
        if self.attention_backend.kv_format.is_low_bit:
            self.recent_kv = RecentKV(
                self.model.attention_layers(),
                config.cache.block_size,
                config.model.arch.head_dim,
                config.model.dtype,
                self.device,
            )
            self.input_builder.recent_kv = self.recent_kv
        # CPU: map its pages ahead of use (an early pool's prefault is already running)
        self.kv_prefault = _take_prefault(early_kv_pool, self.kv_cache) or _prefault(self.kv_cache)
        # decode-only steps run every decoder layer in one compiled call where it applies (CPU); it
        # runs the whole model (embedding to norm), so a pipeline stage runs the modules
        pipeline = config.parallel.pipeline_parallel_size > 1
        self.decode_stack = None if pipeline else build_decode_stack(model, self.attention_backend)
        if self.decode_stack is not None and self.lora is not None:
            self.decode_stack.bind_lora(self.lora.stack_layers())
        if self.decode_stack is not None and config.model.deterministic:
            self.decode_stack.max_span = self.attention_backend.piece_len  # longer: the modules' pieces
        # Called with each step's final hidden states, whichever path made them (evaluation and
        # draft-head training read them here: the fused stack runs no module hooks).
        self.hidden_hooks: list[Callable[[torch.Tensor], None]] = []
        cache = config.cache
        # Block-granular views for swapping: [layers, 2, blocks, block_size, kv_heads, head_dim].
        self.kv_blocks = self.kv_cache.view(
            *self.kv_cache.shape[:2], -1, cache.block_size, *self.kv_cache.shape[3:]
        )
        self.swap_space = None
        if cache.num_swap_blocks:
            self.swap_space = torch.empty(
                *self.kv_blocks.shape[:2],
                cache.num_swap_blocks,
                *self.kv_blocks.shape[3:],
                dtype=self.kv_cache.dtype,
                device="cpu",
                pin_memory=self.device.type == "cuda",
            )
        # RAM and disk tiers under the prefix cache (core/kv_tiers.py decides, this copies)
        self.kv_tier_store = KVTierStore(config, self.kv_blocks) if cache.kv_offloading is not None else None
        self.kv_connector = create_connector(config, self.kv_blocks)  # a prefill instance's sender
        self.kv_receiver = create_receiver(config, self.kv_blocks)  # a decode instance's, over gloo
        # after the pool, whose addresses graphs capture (the start-up time includes the capture);
        # padded rows write to the block past the pool's blocks
        self.decode_graphs = None
        if self._static_decode:
            self.decode_graphs = DecodeGraphs.create(model, config, scratch_block=config.cache.num_blocks)

    def _uses_static_decode(self) -> bool:
        """Whether decode steps run on static buffers as CUDA graphs: on a one-rank CUDA engine (not
        --enforce-eager) whose pool is final (not the memory profile's), whose attention reads block
        tables in place, with one KV-cache group and no mixture of experts (its routing sizes the
        experts' work on the host). A pipeline stage or tensor-parallel rank runs eagerly."""
        config = self.config
        return (
            self.device.type == "cuda"
            and not config.model.enforce_eager
            and config.parallel.world_size == 1
            and config.cache.size_from_gpu_memory is None
            and not config.cache.kv_groups
            and not self.attention_backend.needs_gathered_decode
            and not config.model.arch.num_experts
            and config.lora is None
        )

    def _allocate_kv_cache(self) -> torch.Tensor:
        """The pool and each attention layer's views of it; with the static decode step, one scratch
        block past the blocks the block manager hands out (its padded rows' K/V)."""
        arch, cache = self.config.model.arch, self.config.cache
        layers = self.model.attention_layers()
        # On CPU, torch.empty of a large pool is fresh zero pages from the OS without touching them
        # all now (torch.zeros of a pool would cost start-up time; prefault.py maps them in the
        # background instead); no backend reads a slot before it is written except masked padding.
        # Devices get explicit zeros.
        allocate = torch.empty if self.device.type == "cpu" else torch.zeros
        kv_format = self.attention_backend.kv_format  # 8-bit rows carry their scale (kv_format.py)
        groups = [tuple(range(len(layers)))]  # one group: this stage's layers in order
        if cache.kv_groups:  # a group's layers of this stage (model layer indices), by position
            position = {index: i for i, index in enumerate(self.model.stage.layers)}
            groups = [tuple(position[i] for i in stage_layers(g, position)) for g in cache.kv_groups]
        shape = (
            max(len(group) for group in groups),
            2,
            (cache.num_blocks + self._static_decode) * cache.block_size,
            layers[0].num_kv_heads,  # this rank's KV heads (all of them without tensor parallelism)
            kv_format.row_size(arch.head_dim),
        )
        dtype = kv_format.storage_dtype(self.config.model.dtype)
        early = None if self._early_kv_pool is None else self._early_kv_pool.tensor
        if (
            early is not None
            and early.shape == shape
            and early.dtype == dtype
            and early.device == self.device
        ):
            kv_cache = early
        else:
            kv_cache = allocate(*shape, dtype=dtype, device=self.device)
        for group_index, group in enumerate(groups):
            for index, layer in enumerate(layers[i] for i in group):
                layer.key_cache, layer.value_cache = kv_cache[index, 0], kv_cache[index, 1]
                layer.backend, layer.kv_group = self.attention_backend, group_index
        return kv_cache

    def wait_for_kv_prefault(self) -> None:
        """Block until the KV pool's pages are mapped, mapping them in this thread too. Benchmarks and
        the warm-up call it before timing or serving anything: the background prefault (one core, for a
        while) would otherwise share the cores with the first requests."""
        finish = getattr(self.kv_prefault, "finish", None)
        if finish is not None:
            finish()
        elif self.kv_prefault is not None:
            self.kv_prefault.join()

    def keep_draft_probs(self, proposals: dict[str, DraftProposal | None]) -> None:
        """Hold the q of each new proposal for the step that verifies (a prefix of) its drafts."""
        for request_id, proposal in proposals.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.draft_probs = None if proposal is None else proposal.probs

    @torch.inference_mode()
    def move_blocks(self, plan: StepPlan) -> None:
        """Copy preempted requests' blocks to the swap space, evicted and hit blocks to and from the KV
        tiers, resumed ones back, and shared blocks about to be written (copy-on-write), before the
        step's forward writes into any of them. Swap-outs read first (a block freed by one may be
        loaded into); tier saves read evicted blocks before swap-ins or loads reuse them."""
        swap_out, swap_in, copies = plan.swap_out, plan.swap_in, plan.block_copies
        if swap_out:
            device_blocks, swap_blocks = map(list, zip(*swap_out, strict=True))
            self.swap_space[:, :, swap_blocks] = self.kv_blocks[:, :, device_blocks].to("cpu")
        if plan.tier_ops:
            self.kv_tier_store.apply(plan.tier_ops)
        if swap_in:
            swap_blocks, device_blocks = map(list, zip(*swap_in, strict=True))
            self.kv_blocks[:, :, device_blocks] = self.swap_space[:, :, swap_blocks].to(self.device)
        if copies:
            sources, destinations = map(list, zip(*copies, strict=True))
            self.kv_blocks[:, :, destinations] = self.kv_blocks[:, :, sources]

    def execute(self, plan: StepPlan) -> ModelRunnerOutput:
        """Apply the plan, then run its requests' new tokens and sample those that caught up; a prefill
        instance then sends the prompt blocks the step finished (before its output leaves the engine)."""
        try:
            output = self._execute(plan)
        except Exception:
            if self.recent_kv is not None:
                self.recent_kv.forget_step()  # its new sink entries may be partly written
            raise
        if plan.kv_exports:
            self.kv_connector.send(plan.kv_exports)
        return output

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> ModelRunnerOutput:
        inputs = self.prepare(plan)
        if inputs is None:
            return ModelRunnerOutput({}, {})
        if inputs.static_size is not None:
            return self._execute_static(inputs)
        hidden = self._forward(inputs)
        prompt_logprobs = {}
        if inputs.prompt_logprob_rows is not None:
            prompt_logprobs = compute_prompt_logprobs(
                inputs.prompt_logprob_rows, hidden, self.model.compute_logits
            )
        pooled = self._pool(hidden, inputs) if inputs.pool_rows else {}
        if not inputs.sample_rows:
            return ModelRunnerOutput({}, {}, prompt_logprobs=prompt_logprobs, pooled=pooled)
        sample_hidden = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(sample_hidden)
        if logits is None:  # a tensor-parallel worker: rank 0 gathered the logits and samples
            return ModelRunnerOutput({}, {})
        output = self.sample(logits, inputs, sample_hidden)
        output.prompt_logprobs, output.pooled = prompt_logprobs, pooled
        return output

    def _execute_static(self, inputs: StepInputs) -> ModelRunnerOutput:
        """A decode step on the static buffers: its size's graph replayed, then sampling as any step.
        Its hidden states are views the next step overwrites (a proposer reads them before)."""
        hidden, logits = self.decode_graphs.run(inputs.static_size, len(inputs.requests))
        for hook in self.hidden_hooks:
            hook(hidden.clone())  # hooks may keep what they get
        return self.sample(logits, inputs, hidden)

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, list[float]]:
        """Embeddings: each finished embedding request's last-token final hidden state (after the
        model's final norm), in float32, L2-normalized (docs/server.md says why the last token)."""
        vectors = torch.nn.functional.normalize(hidden[inputs.pool_indices].float(), dim=-1).tolist()
        ids = [inputs.requests[row].request_id for row in inputs.pool_rows]
        return dict(zip(ids, vectors, strict=True))

    def prepare(self, plan: StepPlan) -> StepInputs | None:
        """Apply the plan (request states, block moves); the step's flat inputs, None without tokens."""
        apply_plan(self.requests, plan, self.device)
        if self.recent_kv is not None:
            self.recent_kv.release(plan.finished_request_ids)
        self.move_blocks(plan)
        if not plan.num_scheduled_tokens:
            return None
        rows = [(self.requests[rid], n) for rid, n in plan.num_scheduled_tokens.items()]
        if plan.spec_tree_parents and not self.input_builder.takes_trees([n for _, n in rows]):
            # trees the backend cannot verify in place (or beside a prompt chunk): the reference attention
            return self.tree_input_builder.build(rows, None if self.lora is None else self._lora_slots)
        if self.decode_graphs is not None and self.decode_graphs.serves(rows):
            return self._prepare_static([request for request, _ in rows])
        return self.input_builder.build(rows, None if self.lora is None else self._lora_slots)

    def _lora_slots(self, requests: list[CachedRequestState]) -> np.ndarray:
        """Each request's LoRA slot (-1: the base model), its adapter swapped in where it is not."""
        return self.lora.row_slots([request.sampling_params.lora_name for request in requests])

    def _prepare_static(self, requests: list[CachedRequestState]) -> StepInputs:
        """A decode step's inputs staged in the static buffers (one copy), padded to a captured size."""
        static = self.decode_graphs.stage(requests)
        return StepInputs(
            requests=requests,
            input_ids=static.input_ids,
            positions=static.positions,
            attention=static.attention,
            sample_rows=list(range(len(requests))),
            logits_indices=static.rows[: len(requests)],
            static_size=len(static.input_ids),
        )

    @torch.inference_mode()
    def run_stage(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Pipeline parallelism: this stage's layers on the step's tokens, from the previous stage's
        `hidden` (None on the first stage): the output for the next stage, or on the last the
        sampling rows' final hidden states (`stage_logits` turns them into logits)."""
        with set_forward_context(inputs.attention):
            hidden = self.model(inputs.input_ids, inputs.positions, hidden)
        return hidden[inputs.logits_indices] if self.model.stage.is_last else hidden

    @torch.inference_mode()
    def stage_logits(self, sample_hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The last stage: the sampling rows' logits (None without sampling rows, or on a
        tensor-parallel rank other than the stage's first)."""
        return self.model.compute_logits(sample_hidden) if inputs.sample_rows else None

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs, sample_hidden: torch.Tensor | None = None
    ) -> ModelRunnerOutput:
        """Sample (or verify drafts for) the step's sampling rows from their logits."""
        sampling_requests = [inputs.requests[row] for row in inputs.sample_rows]
        self._start_grammars(sampling_requests)
        if any(r.spec_tree_parents for r in sampling_requests):
            output = self._verify_with_trees(logits, sampling_requests)
            if sample_hidden is not None:  # rows in path order, as a chain's (proposers read them so)
                order = tree_hidden_rows(sampling_requests, output.tree_paths)
                sample_hidden = sample_hidden[order.to(sample_hidden.device)]
        else:
            output = self._sample_or_verify(logits, sampling_requests)
        output.sampled_requests, output.sample_hidden = sampling_requests, sample_hidden
        return output

    def _verify_with_trees(
        self, logits: torch.Tensor, requests: list[CachedRequestState]
    ) -> ModelRunnerOutput:
        """A step with token trees: the trees through the tree verifier, the other requests (chains,
        plain decodes) as in any step, each on its own logits rows; then the accepted paths' KV is
        moved into place."""
        is_tree = [r.spec_tree_parents is not None for r in requests]
        counts = [1 + len(r.spec_token_ids) for r in requests]
        trees = [r for r, tree in zip(requests, is_tree, strict=True) if tree]
        failed: list[str] = []
        verified = self.tree_verifier(
            logits[_rows_where(counts, is_tree, True, logits.device)], trees, failed
        )
        output = ModelRunnerOutput(verified.token_ids, verified.logprobs, failed=failed)
        others = [r for r, tree in zip(requests, is_tree, strict=True) if not tree]
        if others:
            rest = self._sample_or_verify(logits[_rows_where(counts, is_tree, False, logits.device)], others)
            output.sampled_token_ids.update(rest.sampled_token_ids)
            output.logprobs.update(rest.logprobs)
            output.failed += rest.failed
        move_accepted_kv(self.kv_cache, self.block_size, trees, verified.paths)
        output.tree_paths = verified.paths
        return output

    def _start_grammars(self, requests: list[CachedRequestState]) -> None:
        """A matcher for each structured-output request sampling for the first time (its grammar was
        compiled before the engine admitted it: a cache hit)."""
        for request in requests:
            spec = request.sampling_params.structured_outputs
            if spec is not None and request.grammar is None:
                request.grammar = GrammarState(self.grammar_compiler.compile(spec))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model's final hidden states for the step's flat batch; a decode-only step takes the
        fused stack where it applies (the same kernels in one call: bit-identical)."""
        lora = contextlib.nullcontext() if self.lora is None else self.lora.activate(inputs.lora_slots)
        with set_forward_context(inputs.attention), lora:
            stack = self.decode_stack
            lora_slots = None if self.lora is None else self.lora.token_slots
            if lora_slots is not None and stack is not None and not stack.lora_bound:
                stack = None  # adapters the stack cannot add: the modules
            if inputs.attention.backend is not None:  # a token tree's step: the modules, on the reference
                stack = None
            if stack is not None and stack.serves(len(inputs.input_ids), inputs.attention):
                hidden = stack(inputs.input_ids, inputs.positions, inputs.attention, lora_slots)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions)
        for hook in self.hidden_hooks:
            hook(hidden)
        return hidden

    @contextlib.contextmanager
    def capture_hidden_states(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, every step's final hidden states are appended to the yielded list."""
        captured: list[torch.Tensor] = []
        self.hidden_hooks.append(captured.append)
        try:
            yield captured
        finally:
            self.hidden_hooks.remove(captured.append)

    def _sample_or_verify(
        self, logits: torch.Tensor, sampling_requests: list[CachedRequestState]
    ) -> ModelRunnerOutput:
        if any(r.spec_token_ids for r in sampling_requests):  # speculative decoding: verify the drafts
            draft_probs = {  # sampled drafts carry their q
                r.request_id: r.spec_token_probs for r in sampling_requests if r.spec_token_probs is not None
            }
            failed: list[str] = []  # a raising logits processor fails only its requests
            tokens, logprobs = self.verifier(logits, sampling_requests, draft_probs, failed)
            return ModelRunnerOutput(tokens, logprobs, failed=failed)
        metadata = SamplingMetadata.build(
            params=[r.sampling_params for r in sampling_requests],
            prompt_token_ids=[r.prompt_token_ids for r in sampling_requests],
            output_token_ids=[r.output_token_ids for r in sampling_requests],
            generators=[r.generator for r in sampling_requests],
            eos_token_ids=[r.eos_token_ids for r in sampling_requests],
            vocab_size=self.vocab_size,
            device=self.device,
            grammars=[r.grammar for r in sampling_requests],
        )
        processing = metadata.logits_processing
        if processing is not None:
            processing.isolate_failures = True  # a raising processor fails its requests (output.failed)
        output = self._to_output(sampling_requests, self.sampler(logits, metadata))
        if processing is not None and processing.failed_rows:
            output.failed = [sampling_requests[row].request_id for row in sorted(processing.failed_rows)]
        return output

    @staticmethod
    def _to_output(requests: list[CachedRequestState], sampled: SamplerOutput) -> ModelRunnerOutput:
        if sampled.logprobs is None:
            token_ids = sampled.sampled_token_ids.tolist()  # the one host sync of the step
            return ModelRunnerOutput(
                sampled_token_ids={r.request_id: [t] for r, t in zip(requests, token_ids, strict=True)},
                logprobs={},
            )
        rows = _logprob_rows(sampled)  # still the step's one host sync
        num_top = sampled.logprobs.shape[1]
        output = ModelRunnerOutput(
            {r.request_id: [int(row[0])] for r, row in zip(requests, rows, strict=True)}, {}
        )
        for row, request in zip(rows, requests, strict=True):
            num = request.sampling_params.logprobs
            if num is None:
                continue
            entry = dict(zip(map(int, row[1 : 1 + num]), row[1 + num_top : 1 + num_top + num], strict=True))
            entry[int(row[0])] = row[-1]
            output.logprobs[request.request_id] = [entry]
        return output


def _prefault(pool: torch.Tensor) -> PrefaultThread | None:
    """The pool's background prefault; its planes are [tensor, K/V] slices, each block-indexed."""
    return populate_in_background(pool, planes=pool.shape[0] * pool.shape[1])


def _take_prefault(early: EarlyKVPool | None, kv_cache: torch.Tensor) -> PrefaultThread | None:
    """The early pool's prefault where the runner took that pool; else it is stopped (its memory goes
    back) and None."""
    if early is None or early.prefault is None:
        return None
    if early.tensor is kv_cache:
        return early.prefault
    early.prefault.chunks.stop()
    return None


def _logprob_rows(sampled: SamplerOutput) -> list[list[float]]:
    """Per row [sampled id, top-N ids, top-N log-probs, the sampled token's log-prob], moved to the
    host in one copy: float64 holds the ids (below 2**53) and the float32 values exactly."""
    columns = (
        sampled.sampled_token_ids[:, None],
        sampled.logprobs_token_ids,
        sampled.logprobs,
        sampled.sampled_logprobs[:, None],
    )
    return torch.cat([column.double() for column in columns], dim=1).tolist()


def _rows_where(counts: list[int], flags: list[bool], value: bool, device: torch.device) -> torch.Tensor:
    """The logits rows of the requests whose flag is `value` (request i has counts[i] rows, in order)."""
    ends = np.cumsum(counts)
    rows = [
        np.arange(end - count, end)
        for count, end, flag in zip(counts, ends, flags, strict=True)
        if flag == value
    ]
    return torch.from_numpy(np.concatenate(rows)).to(device)
