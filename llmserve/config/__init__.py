"""Engine configuration: one frozen dataclass per concern (speculative.py: SpeculativeConfig,
quantization.py: QuantizationConfig, parallel.py: ParallelConfig; the rest here), the lowest layer
every package may import.

Every field carries a one-line docstring-style comment that doubles as CLI help. "auto" values are
resolved by `EngineConfig.create` before freezing and never mutated later.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from llmserve.config.cpu_isa import selected_level
from llmserve.config.families import check_family_features
from llmserve.config.flags import add_flags, arg, check_choice, from_namespace
from llmserve.config.kv_cache_dtype import (
    LOW_BIT_GROUP,
    KVCacheDtype,
    check_kv_cache_dtype,
    check_low_bit_kv,
    is_low_bit,
    kv_row_bytes,
    kv_storage_dtype,
)
from llmserve.config.kv_events import KVEventsConfig
from llmserve.config.kv_groups import KVCacheGroup, group_size, kv_cache_groups
from llmserve.config.kv_offloading import KVOffloadingBackend, KVOffloadingConfig
from llmserve.config.kv_transfer import KVTransferConfig
from llmserve.config.lora import LORA_KERNEL_MAX_WIDTH, LoRAConfig
from llmserve.config.parallel import (
    All2AllBackend,
    ExecutorBackend,
    NodeArgs,
    ParallelConfig,
    check_expert_split,
    stage_layer_ranges,
)
from llmserve.config.quantization import (
    CALIBRATED_METHODS,
    GGUF_BLOCK_COLUMNS,
    GGUF_BLOCK_TYPES,
    PACKED_KERNEL_DEVICES,
    QuantizationConfig,
    int_kernels_take,
)
from llmserve.config.speculative import (
    DEFAULT_DISABLE_BATCH_SIZE,
    LIGHT_PROPOSERS,
    TREE_METHODS,
    SpeculativeConfig,
    SuffixDecodingConfig,
)
from llmserve.config.structured_outputs import StructuredOutputsConfig

logger = logging.getLogger("llmserve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CONSUMER_RAM_BYTES = 1 << 30  # a decode instance's RAM tier when --kv-offloading-size is not given

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
# "torch" the reference, "cpu_paged" the compiled CPU kernel, "triton" the CUDA one (attention/registry.py)
AttentionBackendName = Literal["auto", "torch", "cpu_paged", "triton"]
SchedulingPolicy = Literal["fcfs", "priority"]  # priority: a lower priority value runs first
PreemptionMode = Literal["recompute", "swap", "auto"]  # auto: the cheaper by estimate


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture hyper-parameters, read from a HF config.json or from GGUF metadata."""

    architecture: str  # a key of models/registry.py (llama, mistral, qwen2, qwen3, phi3, gemma2, ...)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    rope_scaling: dict | None = None  # HF rope_scaling dict ("llama3", "linear", "dynamic" ...)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    # Family features (models/registry.py picks the module classes that read them)
    qk_norm: bool = False  # RMSNorm of each query and key head before rope (Qwen3, Gemma 3)
    partial_rotary_factor: float = 1.0  # rope rotates this fraction of each head (Phi-3/4)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma); None: head_dim
    attn_logit_softcapping: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the output logits (Gemma 2)
    # per layer "sliding_attention" (attends within sliding_window) or "full_attention" (Gemma 2/3);
    # None: every layer alike (all sliding when sliding_window is set, as Mistral)
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # rope base of sliding layers (Gemma 3); None: rope_theta
    num_experts: int = 0  # mixture-of-experts layers' experts (Mixtral); 0: dense MLPs
    num_experts_per_tok: int = 0  # experts each token is routed to
    moe_intermediate_size: int | None = None  # each expert's hidden units; None: intermediate_size
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights to sum 1 (Qwen3-MoE: a flag)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in a mixture-of-experts model (Qwen3-MoE)
    # a pre-quantized HF checkpoint's quant_method (gptq, awq, ...: model_loader/prequantized.py); None: float
    checkpoint_quantization: str | None = None
    # the types ("F32", "Q4_1", ...) of a GGUF's tensors a forward multiplies by (an untied token_embd is
    # only looked up): those of GGUF_BLOCK_TYPES make --quantization gguf the CPU's default; () for HF
    gguf_tensor_types: tuple[str, ...] = ()

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V for one token across all layers (times the dtype size for bytes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(
        self,
        dtype: torch.dtype,
        kv_cache_dtype: KVCacheDtype = "auto",
        num_kv_heads: int | None = None,
        num_layers: int | None = None,
    ) -> int:
        """Bytes of K and V for one token across all layers, scales of an 8-bit cache included; of
        `num_kv_heads` heads where given (one tensor-parallel rank's), else of all, and of
        `num_layers` layers where given (one pipeline stage's)."""
        row_bytes = kv_row_bytes(kv_cache_dtype, self.head_dim, dtype)
        heads = self.num_key_value_heads if num_kv_heads is None else num_kv_heads
        layers = self.num_hidden_layers if num_layers is None else num_layers
        return 2 * layers * heads * row_bytes


@dataclass(frozen=True)
class ModelConfig:
    path: str  # resolved path of the GGUF file or HF directory
    arch: ModelArchConfig
    dtype: torch.dtype  # compute and weight dtype
    max_model_len: int  # longest prompt + output a request may have
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0  # seed of the engine-wide generator for unseeded sampled requests
    attention_backend: AttentionBackendName = "auto"  # "auto": the fastest that fits (attention/registry.py)
    quantization: QuantizationConfig | None = None  # weight quantization (llmserve/quantization); None: float
    enforce_eager: bool = False  # CUDA: every step eagerly, no decode graphs (worker/cuda_graphs.py)
    # batch-invariant kernels: a row's result never depends on the rest of its step
    # (worker/batch_invariance.py, docs/reliability.md); None: the runner decides (on where it changes
    # attention alone: batch_invariance.on_by_default)
    deterministic: bool | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        check_choice("attention_backend", self.attention_backend, AttentionBackendName)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    num_blocks: int  # blocks in the preallocated pool
    kv_cache_memory: int  # bytes the pool takes (K and V, all layers)
    enable_prefix_caching: bool = True  # reuse computed KV blocks of identical token prefixes
    num_swap_blocks: int = 0  # blocks of CPU swap space for preempted requests
    kv_cache_dtype: KVCacheDtype = (
        "auto"  # storage of K/V rows: "auto" (the model dtype), int8, fp8, int4, int2
    )
    sliding_window: int = 0  # keep only the last this many tokens' KV (0: keep all)
    attention_sinks: int = 0  # with a window: also keep the first this many tokens (StreamingLLM)
    kv_events: KVEventsConfig | None = None  # publish the prefix cache's changes; None: off
    kv_offloading: KVOffloadingConfig | None = None  # RAM and disk tiers under the prefix cache; None: off
    kv_transfer: KVTransferConfig | None = None  # a prefill or decode instance; None: neither
    # layers by attention kind, one block table each (config/kv_groups.py); (): one group of every
    # layer, with `sliding_window`
    kv_groups: tuple[KVCacheGroup, ...] = ()
    # CUDA with no size given: the pool holds only the profiling step's blocks until the engine has
    # measured the device (worker/gpu_memory.py) and resolved the config again, sizing the pool from this
    # fraction of the device's memory; None: the pool's size is final
    size_from_gpu_memory: float | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {self.num_blocks}")
        if min(self.num_swap_blocks, self.sliding_window, self.attention_sinks) < 0:
            raise ValueError("num_swap_blocks, sliding_window and attention_sinks must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int  # token budget of one engine step (prefill chunks + decodes)
    max_num_seqs: int  # most requests running at once
    max_model_len: int  # longest prompt + output
    enable_chunked_prefill: bool = True  # split long prompts across steps, mixed with decodes
    scheduling_policy: SchedulingPolicy = "fcfs"  # "fcfs" or "priority" (lower priority value = more urgent)
    priority_aging_seconds: float = 60.0  # waiting this long improves a request's priority by one
    preemption_mode: PreemptionMode = "auto"  # "recompute", "swap" (to CPU) or "auto" (cheaper by estimate)
    ttft_target_ms: float | None = 1000.0  # time-to-first-token target of every request (None or 0: none)
    tpot_target_ms: float | None = 50.0  # time-per-output-token target of every request (None: none)
    max_loras: int | None = None  # distinct LoRA adapters among the running requests at most (None: off)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        check_choice("preemption_mode", self.preemption_mode, PreemptionMode)
        if self.priority_aging_seconds <= 0:
            raise ValueError("priority_aging_seconds must be > 0")
        for target in (self.ttft_target_ms, self.tpot_target_ms):
            if target is not None and not 0 <= target < math.inf:
                raise ValueError("ttft_target_ms and tpot_target_ms must be >= 0 (0: no target)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tensor and pipeline parallelism
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig | None = None  # LoRA adapters over the base model (llmserve/lora); None: off


def _why_no_gguf_default(
    arch: ModelArchConfig, device: torch.device, dtype: torch.dtype, parallel: ParallelConfig
) -> str | None:
    """Why a GGUF's own blocks cannot be this configuration's default; None where they can."""
    if device.type not in PACKED_KERNEL_DEVICES:
        return f"no int4/int8 kernel on {device.type}"
    level = selected_level()
    if level is None:
        return "no compiled int4/int8 kernels on this CPU"
    if not int_kernels_take(dtype, level.name):
        name = str(dtype).removeprefix("torch.")
        return f"the int4/int8 kernels of the {level.name} level take bfloat16 inputs, not {name}"
    shares = parallel.row_parallel_in_features(arch)
    if any(width % GGUF_BLOCK_COLUMNS for width in shares):
        return f"the tensor-parallel ranks' input widths {shares} cut the file's blocks"
    try:  # what gguf does not combine with (a family, experts split over ranks)
        tp, expert_parallel = parallel.tensor_parallel_size, parallel.enable_expert_parallel
        check_family_features(arch, "gguf", tp, None, expert_parallel)
    except ValueError as error:
        return str(error)
    return None


def default_kv_cache_memory(dtype: torch.dtype, kv_cache_dtype: KVCacheDtype = "auto") -> int:
    """The pool's default size: 1 GiB for 16-bit (or 8-bit) K/V entries, 2 GiB for float32 ones, so
    that the default holds as many tokens whatever the dtype (about 46,000 for SmolLM2): a smaller
    float32 pool did not hold the mixed-100 workload at once, and its last prompts waited for others
    to finish."""
    entry_bytes = kv_storage_dtype(kv_cache_dtype, dtype).itemsize
    return 2 << 30 if entry_bytes >= 4 else 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as the engine measured it after loading the weights and running one profiled
    step (worker/gpu_memory.py): what `gpu_memory_utilization` sizes the KV pool from."""

    total: int  # bytes the device has
    free: int  # bytes free once the weights are loaded and the profiled step's activations released
    weights: int  # bytes the engine holds after loading (the weights)
    peak_activations: int  # the profiled step's peak above that: activations, logits, sampling


def gpu_kv_cache_memory(utilization: float, memory: DeviceMemory) -> int:
    """The KV pool's bytes on a GPU: what the weights and a step's peak activations leave of
    `utilization` of the device's memory (vLLM's --gpu-memory-utilization, a per-engine share:
    other processes' memory does not count against it, but must leave the pool room)."""
    allowed = int(memory.total * utilization)
    pool = allowed - memory.weights - memory.peak_activations
    if pool <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {_gib(allowed)} of the device's "
            f"{_gib(memory.total)}, and the weights ({_gib(memory.weights)}) and a step's activations "
            f"({_gib(memory.peak_activations)}) leave nothing for the KV cache: raise it, or lower "
            "max_num_batched_tokens"
        )
    if pool + memory.peak_activations > memory.free:
        raise ValueError(
            f"the device has {_gib(memory.free)} free after loading, less than the KV cache and a step's "
            f"activations take at gpu_memory_utilization={utilization} "
            f"({_gib(pool + memory.peak_activations)}): other processes hold the rest; lower "
            "gpu_memory_utilization or give kv_cache_memory"
        )
    return pool


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def profile_step_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the step the GPU's memory is profiled with, the largest the scheduler can
    plan: as many sequences as it runs at once, the budget's tokens given to the first ones, each as
    long as max_model_len lets a prompt be (the longest attention), one token for the rest (every row
    samples: the most logits)."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    lengths = [1] * rows
    left = max_num_batched_tokens - rows
    for row in range(rows):
        extra = min(left, max(max_model_len - 2, 0))  # a prompt leaves room for one token
        lengths[row] += extra
        left -= extra
    return lengths


# The scheduler's limits where none are given, by device: (max_num_batched_tokens, max_num_seqs).
# On a GPU vLLM's: 256 sequences, not its newer 1024 for H100-class cards, because decode graphs are
# captured per batch size up to max_num_seqs, and past 256 rows a decode step reads the same weights
# for rows that mostly wait on KV memory anyway.
_SCHEDULER_DEFAULTS = {"cpu": (2048, 128), "cuda": (8192, 256)}


def profile_step_blocks(scheduler: SchedulerConfig, block_size: int) -> int:
    """The KV blocks of the step the GPU's memory is profiled with (`profile_step_lengths`)."""
    lengths = profile_step_lengths(
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs, scheduler.max_model_len
    )
    return sum(-(-length // block_size) for length in lengths)


def default_scheduler_limits(device: torch.device) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) where none are given: the CPU's as they always were; on
    a GPU vLLM's, whose 8192-token steps (prompts chunked) keep the matrix units busy."""
    return _SCHEDULER_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]


def default_block_size(device: torch.device) -> int:
    """Tokens per KV block where none is given: 32 on a CPU, 16 elsewhere (as vLLM, which takes 128 on
    a CPU). Once a server has run a while its free blocks come back in no useful order, so a sequence's
    blocks lie scattered over the pool; a CPU reads each block's rows from DRAM as one run, and longer
    runs read faster (32 beat 16 through HTTP and offline in that state). Prefix caching then shares
    prompts in steps of 32."""
    return 32 if device.type == "cpu" else 16


@dataclass
class EngineArgs:
    """User-facing engine options (CLI flags and `LLM(...)` keyword arguments).

    `create_config` resolves them into the frozen per-concern configs.
    """

    model: str | None = arg(
        None,
        "GGUF file, HF model directory, or org/name[@revision] in the local HF cache (never downloaded); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    dtype: DTypeName = arg(
        "auto",
        "float32 | bfloat16 | float16 | auto (bfloat16; on a CPU without native bf16, float32 where a "
        "model or option would run PyTorch's bf16 arithmetic)",
    )
    device: str = arg("auto", "cpu | cuda | auto")
    max_model_len: int | None = arg(
        None, "longest prompt + output; default: the model's context, at most 4096"
    )
    block_size: int | None = arg(None, "tokens per KV-cache block; default 32 on a CPU, 16 on a GPU")
    kv_cache_memory: int | str | None = arg(
        None,
        "KV-cache pool size: bytes or with a unit (512MiB, 2GiB); default on a CPU 1GiB, or 2GiB where "
        "K/V are stored in float32 (the same number of tokens); on a GPU from gpu_memory_utilization",
    )
    num_kv_blocks: int | None = arg(None, "exact KV pool size in blocks (overrides kv_cache_memory)")
    gpu_memory_utilization: float = arg(
        0.9,
        "CUDA: the fraction of the device's memory this engine may use; the KV pool gets what the weights "
        "and a profiled step's activations leave of it (unless kv_cache_memory or num_kv_blocks is given)",
    )
    max_num_batched_tokens: int | None = arg(
        None,
        "token budget of one engine step (prefill chunks + decodes); default 2048 on a CPU, 8192 on a GPU",
    )
    max_num_seqs: int | None = arg(None, "most requests running at once; default 128 on a CPU, 256 on a GPU")
    enable_chunked_prefill: bool = arg(True, "split long prompts across steps, mixed with decodes")
    scheduling_policy: SchedulingPolicy = arg(
        "fcfs", "fcfs | priority (lower priority value runs first; aging avoids starvation)"
    )
    priority_aging_seconds: float = arg(
        60.0, "waiting this many seconds improves a request's priority by one"
    )
    preemption_mode: PreemptionMode = arg(
        "auto", "recompute | swap | auto: how to preempt (auto: cheaper by cost estimate)"
    )
    ttft_target_ms: float = arg(
        1000.0,
        "time-to-first-token target (ms); the scheduler plans first tokens by half of it, keeping the "
        "rest as a margin; a request's ttft_target_ms overrides it; 0: none (docs/scheduling.md)",
    )
    tpot_target_ms: float = arg(
        50.0,
        "time-per-output-token target (ms): prompt chunks are sized so that the running decodes meet it; "
        "a request's tpot_target_ms overrides it; 0: none",
    )
    swap_space: int | str = arg("1GiB", "CPU memory for the KV of requests preempted by swapping")
    prefix_caching: bool = arg(True, "reuse the KV of identical prompt prefixes (automatic prefix caching)")
    kv_cache_dtype: KVCacheDtype = arg(
        "auto",
        "auto (the model dtype) | int8 | fp8: K/V stored in 8 bits with a scale per token and head | "
        "int4 | int2: KIVI (keys per channel over a block of 32, values per token), each sequence's "
        "incomplete 128-token span and first 4 tokens in full precision",
    )
    sliding_window: int | None = arg(
        None, "attend to and keep only the last W tokens' KV (default: the model's own window, if any)"
    )
    attention_sinks: int = arg(
        0, "with a sliding window: also keep the first S tokens (StreamingLLM attention sinks)"
    )
    disable_hybrid_kv_cache_manager: bool = arg(
        False,
        "keep every position's KV in the sliding layers of a model mixing sliding and global layers "
        "(Gemma 2/3; the window then only masks) instead of only their window's",
    )
    seed: int = arg(0, "seed for requests that sample without their own seed")
    attention_backend: AttentionBackendName = arg(
        "auto",
        "auto | torch (reference) | cpu_paged (compiled CPU kernel) | triton (CUDA kernel); "
        "both kernels read the cache in place",
    )
    enforce_eager: bool = arg(
        False, "CUDA: run every step eagerly, capturing no CUDA graphs of decode steps (vLLM's flag)"
    )
    deterministic: bool | None = arg(
        None,
        "batch-invariant kernels (CPU): a request's greedy tokens and logprobs are bitwise the same whatever "
        "else runs, however its prompt is chunked or cached (vLLM's VLLM_BATCH_INVARIANT, SGLang's "
        "--enable-deterministic-inference); default: on where it changes attention alone (a bf16 model whose "
        "linear kernels are invariant already, one rank, no speculation); /server_info says whether the "
        "configuration is",
    )
    kv_events_config: str | None = arg(
        None,
        "publish KV-cache events for a prefix-aware router, as vLLM: a JSON object such as "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
    )
    # -- KV offloading: RAM and disk tiers under the prefix cache (docs/kv_cache.md) --
    kv_offloading_size: float | None = arg(
        None, "GiB of host RAM for prefix-cached KV blocks evicted from the pool (vLLM's flag); default: off"
    )
    kv_offloading_backend: KVOffloadingBackend | None = arg(None, "native (the only one; vLLM's flag)")
    kv_offloading_disk_dir: str | None = arg(
        None, "folder for blocks leaving the RAM tier; kept across restarts of the same model"
    )
    kv_offloading_disk_size: float | None = arg(None, "GiB the disk tier's files may take")
    # -- prefill/decode disaggregation (docs/data_parallel.md) --
    kv_transfer_config: str | None = arg(
        None,
        'start as a prefill or decode instance, as vLLM: a JSON object such as \'{"kv_connector": '
        '"LlmserveConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_dir": DIR}}\'',
    )
    # -- weight quantization (llmserve/quantization, docs/quantization.md) --
    quantization: str | None = arg(
        None,
        "none | int8 (GPTQ-calibrated, per channel) | int8-rtn | int4 | awq | gptq | gguf (the GGUF's own "
        f"blocks: {'/'.join(GGUF_BLOCK_TYPES)}) | DIR (`llmserve quantize`); default: a GGUF file's "
        "blocks on the CPU (gguf), a pre-quantized checkpoint's own codes, else none",
    )
    quantization_group_size: int | None = arg(
        None, "int4 methods: input channels per scale, 32 | 64 | 128 (default: the largest that fits)"
    )
    # -- speculative decoding (llmserve/spec_decode, docs/speculative.md) --
    speculative_method: str | None = arg(
        None,
        "ngram (prompt lookup) | draft (a smaller model) | early_exit (the target's first layers) | "
        "draft_head (prompt lookup, else a small head trained on the target's own outputs) | "
        "suffix (the most frequent continuation in the request's own text and recent requests' outputs) | "
        "medusa (Medusa heads on the last hidden state, a token tree verified in one pass) | "
        "eagle (the draft head expanded as a token tree by its top-k)",
    )
    num_speculative_tokens: int | None = arg(
        None,
        "drafts per step and request at most (K); default 7 for ngram, draft_head and suffix (their drafts "
        "adapt) and for medusa and eagle (K: the token tree's nodes), else 3",
    )
    speculative_draft_model: str | None = arg(
        None, "draft: GGUF file or HF directory of a model with the target's tokenizer"
    )
    speculative_draft_layers: int | None = arg(
        None, "early_exit: target layers in the draft (default: 0.93 of them, see docs/speculative.md)"
    )
    speculative_draft_head: str | None = arg(
        None,
        "draft_head: the head's file (`llmserve train-draft-head`; default: the default model's); "
        "medusa: the Medusa heads' file (required); eagle: the draft head's, as draft_head",
    )
    speculative_draft_head_tokens: int | None = arg(
        None, "draft_head: drafts per step from the head at most (default 3; prompt lookup may propose K)"
    )
    prompt_lookup_min: int = arg(2, "ngram, draft_head: shortest suffix that may match the earlier text")
    prompt_lookup_max: int = arg(6, "ngram, draft_head: longest suffix tried first (draft_head: 0 = none)")
    speculative_disable_batch_size: int | None = arg(
        None,
        "propose nothing while more requests than this run (0: always speculate); default: 0 for a "
        "proposer that runs no model (ngram, suffix, draft_head) over linear layers on the CPU's int8/int4 "
        "kernels (a GGUF's blocks: each verify row costs little at any batch), else 4",
    )
    speculative_adaptive_k: bool = arg(
        True, "each request's drafts per step follow its measured acceptance, up to K (docs/speculative.md)"
    )
    suffix_decoding_max_tree_depth: int = arg(24, "suffix: longest matched suffix plus the drafts after it")
    suffix_decoding_max_cached_requests: int = arg(
        1000, "suffix: finished requests whose outputs are searched too, oldest dropped first (0: none)"
    )
    suffix_decoding_max_spec_factor: float = arg(1.0, "suffix: drafts per matched suffix token at most")
    suffix_decoding_min_token_prob: float = arg(
        0.1, "suffix: stop drafting where the path's estimated probability (from its counts) falls below"
    )
    # -- structured outputs (llmserve/structured, docs/server.md) --
    structured_outputs_compile_timeout: float = arg(
        10.0, "seconds a request's grammar (JSON schema, regex, EBNF) may take to compile; longer is a 400"
    )
    # -- LoRA adapters (llmserve/lora, docs/lora.md) --
    enable_lora: bool = arg(False, "serve LoRA adapters over the base model (a request names one in `model`)")
    lora_modules: tuple[str, ...] = arg(
        (),
        "LoRA adapters to load at start, as name=path (a PEFT directory or a llama.cpp .gguf LoRA file)",
        metavar="NAME=PATH",
        nargs="+",
    )
    max_loras: int = arg(1, "LoRA adapters resident at once (one step's requests use at most this many)")
    max_lora_rank: int = arg(16, "the largest LoRA rank an adapter may have")
    # -- tensor parallelism (llmserve/distributed, docs/parallelism.md) --
    tensor_parallel_size: int = arg(
        1,
        "processes the model is split over (heads, MLP, vocabulary); each holds its heads' KV pool",
        aliases=("-tp",),  # vLLM's short form
    )
    pipeline_parallel_size: int = arg(
        1,
        "stages the decoder layers are split over (each of tensor_parallel_size processes); each holds its "
        "layers' KV pool",
        aliases=("-pp",),
    )
    enable_expert_parallel: bool = arg(
        False,
        "mixture-of-experts models: split the experts over the tensor-parallel ranks (each holds whole "
        "experts) instead of splitting every expert's units",
    )
    all2all_backend: All2AllBackend = arg(
        "naive",
        "expert parallelism's dispatch: naive, every rank computes its experts' pairs of every token "
        "(the tokens are on every rank already) and one all-reduce combines them | all_to_all, each rank "
        "routes a slice of the tokens and sends each pair's row to its expert's rank and back",
    )
    distributed_executor_backend: ExecutorBackend = arg(
        "mp",
        "mp: ranks as processes llmserve starts (on several machines with --nnodes) | ray: Ray actors "
        "placed on the Ray cluster (RAY_ADDRESS, else the one running here, else a new local one)",
    )
    distributed_timeout_seconds: float = arg(
        300.0, "a collective between ranks that waits longer than this fails (a hung rank)"
    )
    # -- multi-node without Ray (docs/parallelism.md, "Multi-node") --
    nnodes: int = arg(1, "mp: machines the tensor-parallel ranks run on (each runs world_size / nnodes)")
    node_rank: int | None = arg(None, "mp with --nnodes: this machine's index; 0 runs the engine")
    master_addr: str | None = arg(None, "mp with --nnodes: node 0's address, reachable from every node")
    master_port: int | None = arg(None, "mp with --nnodes: node 0's rendezvous port (default 29501)")
    check_invariants: bool = arg(
        False, "check the KV cache manager's and block pool's integrity after every step (slow; soak tests)"
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (`--kv-cache-memory` for kv_cache_memory), help text from its metadata."""
        add_flags(parser, cls, "engine")

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        return from_namespace(cls, namespace)

    def __post_init__(self) -> None:
        """The checks each option needs on its own; those that need the model run in create_config."""
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.block_size is not None:
            check_block_size(self.block_size)
        check_choice("dtype", self.dtype, DTypeName)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {self.attention_sinks}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if not (0 <= self.ttft_target_ms < math.inf and 0 <= self.tpot_target_ms < math.inf):
            raise ValueError("ttft_target_ms and tpot_target_ms must be >= 0 (0: no target)")
        self._kv_offloading_flags()
        self._kv_transfer()

    def _kv_transfer(self) -> KVTransferConfig | None:
        text = self.kv_transfer_config
        return None if text is None else KVTransferConfig.from_json(text)

    def _kv_offloading_flags(self) -> KVOffloadingConfig | None:
        return KVOffloadingConfig.create(
            self.kv_offloading_size,
            self.kv_offloading_backend,
            self.kv_offloading_disk_dir,
            self.kv_offloading_disk_size,
        )

    def create_config(
        self,
        arch: ModelArchConfig,
        model_path: str,
        draft_arch: ModelArchConfig | None = None,
        device_memory: DeviceMemory | None = None,
    ) -> EngineConfig:
        """`draft_arch`: the draft model's, whose KV pool (as many blocks) shares kv_cache_memory.
        `device_memory`: a GPU's, measured after loading (worker/gpu_memory.py), which sizes the pool
        where no size is given; without it such a pool holds only the profiling step's blocks."""
        device = resolve_device(self.device)
        parallel = self._parallel(arch)
        dtype, why_float32 = self._dtype(arch, device, parallel)
        quantization = self._quantization(arch, device, dtype, parallel)
        check_family_features(
            arch,
            quantization,
            parallel.tensor_parallel_size,
            self.speculative_method,
            expert_parallel=parallel.enable_expert_parallel,
        )
        scheduler = self._scheduler_config(arch, device)
        config = EngineConfig(
            model=self._model_config(
                arch, model_path, dtype, device, scheduler.max_model_len, parallel, quantization
            ),
            cache=self._cache_config(arch, dtype, device, parallel, scheduler, draft_arch, device_memory),
            scheduler=scheduler,
            speculative=SpeculativeConfig.create(
                method=self.speculative_method,
                num_speculative_tokens=self.num_speculative_tokens,
                prompt_lookup_min=self.prompt_lookup_min,
                prompt_lookup_max=self.prompt_lookup_max,
                draft_model=self.speculative_draft_model,
                draft_layers=self.speculative_draft_layers,
                disable_batch_size=self._speculative_disable_batch_size(device, dtype, quantization),
                draft_head=self.speculative_draft_head,
                draft_head_tokens=self.speculative_draft_head_tokens,
                adaptive_k=self.speculative_adaptive_k,
                suffix=self._suffix_decoding(),
            ),
            parallel=parallel,
            structured_outputs=StructuredOutputsConfig(self.structured_outputs_compile_timeout),
            lora=self._lora(parallel),
        )
        if why_float32:  # said once the whole configuration is valid (a refused flag is the only line)
            logger.info("dtype auto is float32 on this CPU: %s", "; ".join(why_float32))
        return config

    def _dtype(
        self, arch: ModelArchConfig, device: torch.device, parallel: ParallelConfig
    ) -> tuple[torch.dtype, list[str]]:
        """--dtype, and why `auto` chose float32. `auto` is bf16 on a CPU without native bf16 too (AVX2,
        AVX-512 without BF16): the compiled kernels read bf16 weights and K/V, half float32's bytes,
        and compute in float32; but where this model or an option takes a path that runs PyTorch's
        bf16 arithmetic there, many times slower than its float32, it is float32."""
        dtype = resolve_dtype(self.dtype, device)
        if self.dtype != "auto" or device.type != "cpu" or dtype == torch.bfloat16:
            return dtype, []
        why_float32 = self._torch_bf16_paths(arch, parallel)
        return (torch.float32 if why_float32 else torch.bfloat16), why_float32

    def _torch_bf16_paths(self, arch: ModelArchConfig, parallel: ParallelConfig) -> list[str]:
        """What would run PyTorch's bf16 arithmetic on a CPU without native bf16 (no compiled kernel
        takes it there)."""
        try:
            if selected_level() is None:
                return ["no compiled kernels for this CPU"]
        except ValueError as error:  # a forced level this CPU lacks: the kernels' loader refuses it
            return [str(error)]
        paths = []
        if arch.num_experts:
            paths.append("the mixture-of-experts layers multiply in PyTorch")
        if self.enable_lora and 3 * self.max_lora_rank > LORA_KERNEL_MAX_WIDTH:  # q, k and v side by side
            paths.append(
                f"LoRA adapters of rank {self.max_lora_rank} are wider than the compiled delta takes"
            )
        if self.quantization in CALIBRATED_METHODS:
            paths.append(f"quantization {self.quantization} calibrates the float model in PyTorch")
        if self.speculative_method in (*TREE_METHODS, "draft"):
            paths.append(f"speculative method {self.speculative_method} runs PyTorch layers or attention")
        if self.attention_backend == "torch":
            paths.append("the torch attention backend")
        widths = {
            arch.hidden_size,
            arch.num_attention_heads * arch.head_dim,
            arch.intermediate_size,
            *parallel.row_parallel_in_features(arch),
        }
        if any(width % 32 for width in widths):  # the small-batch kernels' column blocks
            paths.append(f"linear layers of input widths {sorted(widths)} not all multiples of 32")
        prompt_attention = "prompt attention runs PyTorch's SDPA"
        if self.kv_cache_dtype in ("int8", "fp8"):  # int4/int2 spans: the prefill kernel on dequantized rows
            paths.append(f"{prompt_attention} over an {self.kv_cache_dtype} KV cache")
        if arch.sliding_window or self.sliding_window or arch.attn_logit_softcapping:
            paths.append(f"{prompt_attention} with a sliding window or score softcapping")
        if arch.head_dim not in (64, 128):
            paths.append(f"{prompt_attention} at head_dim {arch.head_dim}")
        return paths

    def _quantization(
        self, arch: ModelArchConfig, device: torch.device, dtype: torch.dtype, parallel: ParallelConfig
    ) -> str | None:
        """--quantization; by default a GGUF file's own blocks where the engine keeps them (as llama.cpp
        serves a file at its own size), else None (float, or a pre-quantized checkpoint's codes)."""
        if self.quantization is not None:
            return self.quantization
        kept = [kind for kind in arch.gguf_tensor_types if kind in GGUF_BLOCK_TYPES]
        if not kept:
            return None
        why_not = _why_no_gguf_default(arch, device, dtype, parallel)
        if why_not is not None:
            logger.info("the GGUF's %s tensors are served dequantized to float: %s", "/".join(kept), why_not)
            return None
        return "gguf"

    def _speculative_disable_batch_size(self, device: torch.device, dtype: torch.dtype, quantization) -> int:
        """--speculative-disable-batch-size; unset: 0 (speculate at any batch size) where the proposer runs
        no model of its own and the target's linear layers run the CPU's int8/int4 kernels, whose cost per
        verify row stays small at every row count (docs/speculative.md, "Auto mode"), else 4 (bf16 and
        float32 layers leave their small-batch kernels past 8 rows)."""
        if self.speculative_disable_batch_size is not None:
            return self.speculative_disable_batch_size
        if (
            self.speculative_method not in LIGHT_PROPOSERS
            or quantization in (None, "none")
            or device.type != "cpu"
        ):
            return DEFAULT_DISABLE_BATCH_SIZE
        level = selected_level()
        return 0 if int_kernels_take(dtype, level and level.name) else DEFAULT_DISABLE_BATCH_SIZE

    def _suffix_decoding(self) -> SuffixDecodingConfig | None:
        """The suffix proposer's options (validated) where --speculative-method suffix is chosen."""
        if self.speculative_method != "suffix":
            return None
        return SuffixDecodingConfig(
            max_tree_depth=self.suffix_decoding_max_tree_depth,
            max_cached_requests=self.suffix_decoding_max_cached_requests,
            max_spec_factor=self.suffix_decoding_max_spec_factor,
            min_token_prob=self.suffix_decoding_min_token_prob,
        )

    def _lora(self, parallel: ParallelConfig) -> LoRAConfig | None:
        lora = LoRAConfig.create(self.enable_lora, self.lora_modules, self.max_loras, self.max_lora_rank)
        if lora is not None and parallel.pipeline_parallel_size > 1:
            raise ValueError("--enable-lora does not combine with pipeline parallelism yet")
        return lora

    def _scheduler_config(self, arch: ModelArchConfig, device: torch.device) -> SchedulerConfig:
        max_model_len = self.max_model_len or min(arch.max_position_embeddings, 4096)
        default_tokens, default_seqs = default_scheduler_limits(device)
        max_num_batched_tokens = _given(self.max_num_batched_tokens, default_tokens)
        if not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len})"
            )
        return SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=_given(self.max_num_seqs, default_seqs),
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
            priority_aging_seconds=self.priority_aging_seconds,
            # int4/int2: a swapped request's blocks come back under other ids, without their sink entries
            preemption_mode="recompute" if is_low_bit(self.kv_cache_dtype) else self.preemption_mode,
            ttft_target_ms=self.ttft_target_ms or None,
            tpot_target_ms=self.tpot_target_ms or None,
            max_loras=self.max_loras if self.enable_lora else None,
        )

    def _model_config(
        self,
        arch: ModelArchConfig,
        model_path: str,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        parallel: ParallelConfig,
        method: str | None,
    ) -> ModelConfig:
        quantization = QuantizationConfig.create(
            method,
            self.quantization_group_size,
            (
                arch.hidden_size,
                arch.intermediate_size,
                arch.num_attention_heads * arch.head_dim,
                arch.moe_intermediate_size or arch.intermediate_size,  # the experts' down_proj
            ),
            parallel.row_parallel_in_features(arch),
            arch.checkpoint_quantization,
            device.type,
        )
        return ModelConfig(
            path=model_path,
            arch=arch,
            dtype=dtype,
            max_model_len=max_model_len,
            device=device,
            seed=self.seed,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            quantization=quantization,
            deterministic=self._deterministic(device),
        )

    def _deterministic(self, device: torch.device) -> bool | None:
        """--deterministic, where it can hold: the CPU's compiled paged attention (the reference's
        prefill and decode take different SDPA calls; the GPU's kernels are another issue's). Unset:
        None (the model runner decides) where it could hold, else False."""
        if self.deterministic is None:
            possible = device.type == "cpu" and self.attention_backend in ("auto", "cpu_paged")
            return None if possible and self.speculative_method not in TREE_METHODS else False
        if self.deterministic and device.type != "cpu":
            raise ValueError(f"--deterministic runs on the CPU only, not on {device.type}")
        if self.deterministic and self.attention_backend not in ("auto", "cpu_paged"):
            raise ValueError(
                f"--deterministic needs the cpu_paged attention backend, not {self.attention_backend!r}"
            )
        if self.deterministic and self.speculative_method in TREE_METHODS:  # tree steps: the reference
            raise ValueError(
                f"--deterministic does not combine with speculative_method {self.speculative_method} "
                "(token trees run on the reference attention)"
            )
        return self.deterministic

    def _cache_config(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelConfig,
        scheduler: SchedulerConfig,
        draft_arch: ModelArchConfig | None,
        device_memory: DeviceMemory | None,
    ) -> CacheConfig:
        block_size = self.block_size if self.block_size is not None else default_block_size(device)
        if self.block_size is None and is_low_bit(self.kv_cache_dtype):
            block_size = LOW_BIT_GROUP  # a key group is a block
        window, sinks = self._window(arch, scheduler.max_model_len)
        kv_groups = self._kv_groups(arch, scheduler.max_model_len, parallel, draft_arch)
        self._check_low_bit_kv(arch, block_size, window, kv_groups)
        bytes_per_token = self._kv_bytes_per_token(arch, dtype, parallel, kv_groups)
        pool_bytes_per_token = bytes_per_token  # + the draft model's KV, which uses the same block ids
        if draft_arch is not None:
            pool_bytes_per_token += draft_arch.kv_bytes_per_token(dtype, self.kv_cache_dtype)
        block_bytes = pool_bytes_per_token * block_size
        num_blocks, from_gpu = self._pool_blocks(device, dtype, parallel, block_bytes, device_memory)
        if from_gpu is not None:  # until the device is measured: the blocks of the profiled step
            num_blocks = profile_step_blocks(scheduler, block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={self.kv_cache_memory} holds no block of {block_size} tokens "
                f"({block_bytes} bytes each)"
            )
        if self.speculative_method in TREE_METHODS and (window or kv_groups):  # tree masks: full attention
            raise ValueError(
                f"speculative_method {self.speculative_method} (token trees) needs full attention, "
                "no sliding window"
            )
        return CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=num_blocks * block_bytes,
            enable_prefix_caching=self.prefix_caching and not sinks,
            num_swap_blocks=parse_bytes(self.swap_space) // (bytes_per_token * block_size),
            kv_cache_dtype=self.kv_cache_dtype,
            sliding_window=window,
            attention_sinks=sinks,
            kv_events=self._kv_events(),
            kv_offloading=self._kv_offloading(window, parallel, draft_arch, kv_groups),
            kv_transfer=self._kv_transfer(),
            kv_groups=kv_groups,
            size_from_gpu_memory=from_gpu,
        )

    def _kv_bytes_per_token(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        parallel: ParallelConfig,
        kv_groups: tuple[KVCacheGroup, ...],
    ) -> int:
        """One rank's KV bytes per token: each pool holds its rank's KV heads of its stage's layers
        (of one group's layers where there are groups), as many blocks as the rank with the most heads
        in the stage with the most layers."""
        kv_heads = parallel.max_kv_heads_per_rank(arch.num_key_value_heads)
        num_layers = parallel.max_layers_per_stage(arch.num_hidden_layers)
        if kv_groups:
            stages = stage_layer_ranges(arch.num_hidden_layers, parallel.pipeline_parallel_size)
            num_layers = group_size(kv_groups, stages)
        return arch.kv_bytes_per_token(dtype, self.kv_cache_dtype, kv_heads, num_layers)

    def _pool_blocks(
        self,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelConfig,
        block_bytes: int,
        device_memory: DeviceMemory | None,
    ) -> tuple[int, float | None]:
        """(blocks, size_from_gpu_memory): num_kv_blocks, else kv_cache_memory, else in a one-rank CUDA
        engine what gpu_memory_utilization leaves (0 blocks and the fraction until `device_memory` is
        measured), else the fixed default. Tensor- and pipeline-parallel ranks on CUDA keep the
        default: each would profile its own shard, and no machine here has two GPUs to test that on."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks, None
        if self.kv_cache_memory is not None or device.type != "cuda" or parallel.world_size > 1:
            memory = self.kv_cache_memory
            if memory is None:
                memory = default_kv_cache_memory(dtype, self.kv_cache_dtype)
            return parse_bytes(memory) // block_bytes, None
        if device_memory is None:
            return 0, self.gpu_memory_utilization
        return gpu_kv_cache_memory(self.gpu_memory_utilization, device_memory) // block_bytes, None

    def _parallel(self, arch: ModelArchConfig) -> ParallelConfig:
        parallel = ParallelConfig.create(
            self.tensor_parallel_size,
            self.distributed_executor_backend,
            self.distributed_timeout_seconds,
            arch.num_key_value_heads,
            NodeArgs(self.nnodes, self.node_rank, self.master_addr, self.master_port),
            self.pipeline_parallel_size,
            arch.num_hidden_layers,
            self.enable_expert_parallel,
            self.all2all_backend,
        )
        if self.enable_expert_parallel and not arch.num_experts:
            raise ValueError(
                f"--enable-expert-parallel needs a mixture-of-experts model; {arch.architecture} has none"
            )
        if arch.num_experts:
            units = arch.moe_intermediate_size or arch.intermediate_size
            check_expert_split(
                arch.num_experts, units, parallel.tensor_parallel_size, self.enable_expert_parallel
            )
        if parallel.world_size == 1:
            return parallel
        if self.speculative_method == "early_exit":
            raise ValueError(
                "speculative_method early_exit drafts with the target's first layers, which tensor "
                "and pipeline parallelism split over the ranks; use draft_head, draft or ngram"
            )
        if self.speculative_method in TREE_METHODS:  # a tree's accepted KV is moved on the sampling rank only
            raise ValueError(
                f"speculative_method {self.speculative_method} (token trees) runs on one rank; "
                "use draft_head or ngram"
            )
        return parallel

    def _kv_events(self) -> KVEventsConfig | None:
        """The parsed --kv-events-config where it turns events on; None otherwise."""
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.from_json(self.kv_events_config)
        if config.enabled and not self.prefix_caching:
            raise ValueError("--kv-events-config reports prefix-cache changes; --no-prefix-caching is set")
        return config if config.enabled else None

    def _kv_offloading(
        self, window: int, parallel: ParallelConfig, draft_arch: ModelArchConfig | None, kv_groups
    ) -> KVOffloadingConfig | None:
        """The RAM / disk tiers' config (a decode instance's disk tier is the transfer's shared folder);
        refused where a block's KV is not all in the one pool yet."""
        config, transfer = self._kv_offloading_flags(), self._kv_transfer()
        flag = "--kv-offloading-size"
        if transfer is not None:
            config, flag = _with_transfer(config, transfer), "--kv-transfer-config"
        if config is None and transfer is None:
            return None
        refused = None
        if not self.prefix_caching:
            refused = "--no-prefix-caching (the tiers hold prefix-cached blocks)"
        elif parallel.world_size > 1:
            refused = "tensor or pipeline parallelism"
        elif draft_arch is not None or self.speculative_method in ("draft", "early_exit"):
            refused = f"speculative_method {self.speculative_method} (its draft's KV shares the block ids)"
        elif window or kv_groups:
            refused = "a sliding window"
        if refused is not None:
            raise ValueError(f"{flag} does not combine with {refused} yet")
        return config

    def _check_low_bit_kv(self, arch: ModelArchConfig, block_size: int, window: int, kv_groups) -> None:
        """What a 4-bit or 2-bit cache does not combine with yet: its windows and sinks live beside the pool,
        where drafts, transfers, tier files and per-layer tables do not reach."""
        name = self.kv_cache_dtype
        if not is_low_bit(name):
            return
        check_low_bit_kv(name, arch.head_dim, block_size)
        refused = {
            "speculative decoding": self.speculative_method is not None,
            "a sliding window (--sliding-window or the model's own sliding-window layers)": bool(
                window or kv_groups
            ),
            "--kv-transfer-config": self.kv_transfer_config is not None,
            "--kv-offloading-size or --kv-offloading-disk-dir": self._kv_offloading_flags() is not None,
            "--preemption-mode swap": self.preemption_mode == "swap",
        }
        for what, given in refused.items():
            if given:
                raise ValueError(f"kv_cache_dtype {name} does not combine with {what} yet")

    def _window(self, arch: ModelArchConfig, max_model_len: int) -> tuple[int, int]:
        """(window, sinks); (0, 0) when no sequence can outgrow sinks + window anyway."""
        if arch.layer_types is not None and self.sliding_window is not None:
            raise ValueError(
                f"--sliding-window does not combine with {arch.architecture}'s per-layer windows"
            )
        model_window = 0 if arch.layer_types is not None else (arch.sliding_window or 0)  # those mask only
        window = self.sliding_window if self.sliding_window is not None else model_window
        if self.attention_sinks and not window:
            raise ValueError("attention_sinks needs a sliding window (--sliding-window)")
        if not window or window + self.attention_sinks >= max_model_len:
            return 0, 0
        if self.prefix_caching and self.attention_sinks:
            logger.info("prefix caching is off: it does not combine with attention sinks")
        return window, self.attention_sinks

    def _kv_groups(
        self, arch: ModelArchConfig, max_model_len: int, parallel: ParallelConfig, draft_arch
    ) -> tuple[KVCacheGroup, ...]:
        """Per-layer KV-cache groups where sliding layers' KV is bounded by their window; () where the
        model has one kind of layer, no sequence outgrows the window, or the user keeps full KV."""
        types = arch.layer_types
        window = arch.sliding_window or 0
        if types is None or not window or window >= max_model_len or self.disable_hybrid_kv_cache_manager:
            return ()
        groups = kv_cache_groups(types, window)
        if len(groups) == 1 and not groups[0].window:
            return ()
        feature = None
        if draft_arch is not None:
            feature = "a draft model (speculative_method draft)"
        elif self._kv_events() is not None:
            feature = "--kv-events-config"
        if feature is not None:
            raise ValueError(
                f"{feature} does not combine with {arch.architecture}'s bounded sliding-window KV; "
                "pass --disable-hybrid-kv-cache-manager to keep full KV in its sliding layers"
            )
        return groups


def _with_transfer(
    config: KVOffloadingConfig | None, transfer: KVTransferConfig
) -> KVOffloadingConfig | None:
    """The tiers of an instance in a prefill/decode pair: a decode instance's disk tier is the shared
    folder (the producer's files are found there as disk hits), with a RAM tier of its own; a producer's
    tiers are its flags' (it writes the folder from the model runner, not through its tiers)."""
    if not transfer.consumes:
        return config
    if config is None:
        return KVOffloadingConfig(_CONSUMER_RAM_BYTES, transfer.shared_dir, transfer.shared_bytes)
    if config.disk_dir is not None and config.disk_dir != transfer.shared_dir:
        raise ValueError("a kv_consumer's disk tier is its shared_dir; drop --kv-offloading-disk-dir")
    return KVOffloadingConfig(config.ram_bytes, transfer.shared_dir, transfer.shared_bytes)


def check_block_size(block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 where the hardware computes it natively (CUDA, or a CPU with AVX-512 BF16 or
    AMX, where bf16 matmuls run several times faster than float32), float32 otherwise (the model's
    own choice on other CPUs: `EngineArgs._dtype`)."""
    if dtype == "auto":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def cpu_has_native_bf16() -> bool:
    """Whether the compiled kernels' instruction-set level (config/cpu_isa.py: the CPU's best, or the
    lower one LLMSERVE_CPU_ISA forces) has native bf16 (AVX-512 BF16 or AMX)."""
    try:
        level = selected_level()
    except ValueError:  # a forced level this CPU lacks: the kernels' loader says so
        return False
    return level is not None and level.name in ("avx512_bf16", "amx")


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(value: int | str) -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    number = text.rstrip("kmgib")
    unit = text[len(number) :]
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot parse a memory size from {value!r} (use e.g. 512MiB, 2GiB)")
    return int(float(number) * _UNITS[unit])
