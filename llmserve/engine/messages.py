"""The messages between the server process and the engine process, one typed struct per kind.

They travel pickled over multiprocessing pipes (msgspec structs pickle as compactly as tuples). A
request's outputs cross as deltas (`RequestOutputKind.DELTA`) whatever kind it asked for: each
`EngineOutput` holds only what is new since the previous one (the server applies the kind:
async_llm.py), and the prompt never crosses back (the server tokenized it).

  server -> engine, a list per send: AddRequest, AddPoolingRequest, AbortRequest, LoRACommand, Shutdown.
  engine -> server: EngineWarming (loaded, warming up; not sent with --no-warmup) then EngineReady
      (with the warm-up's measured steps), or EngineLoadFailed, once; then StepOutputs after every
      step, RequestAborted for every AbortRequest, RequestsFailed for requests the engine gave up on,
      EngineStatus when its state changed without a step (a tensor-parallel rank exited while idle),
      LoRACommandDone for every LoRACommand.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from llmserve.metrics.stats import EngineGauges, StepStats
from llmserve.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, SpecDecodeStats
from llmserve.sampling_params import SamplingParams


class _Message(msgspec.Struct, array_like=True, gc=False):
    pass


# -- server -> engine ------------------------------------------------------------------------------


class AddRequest(_Message):
    request_id: str
    prompt_token_ids: list[int]  # tokenized and validated by the server
    params: SamplingParams
    arrival_time: float
    priority: int = 0


class AddPoolingRequest(_Message):
    """An embedding request: its prompt runs as a prefill only, its KV is freed once computed, and its
    one output carries the pooled vector (`EngineOutput.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]  # tokenized and validated by the server
    arrival_time: float
    priority: int = 0


class AbortRequest(_Message):
    request_id: str


class LoRACommand(_Message):
    """Load the PEFT adapter at `path` as `name`, or with no path unload adapter `name`
    (/v1/load_lora_adapter, /v1/unload_lora_adapter)."""

    command_id: str
    name: str
    path: str | None = None


class Shutdown(_Message):
    pass


EngineCommand = AddRequest | AddPoolingRequest | AbortRequest | LoRACommand | Shutdown


# -- engine -> server ------------------------------------------------------------------------------


class FailureKind(enum.Enum):
    INVALID = "invalid"  # add_request refused the request
    STEP = "step"  # a step raised: every request in flight is failed
    DEAD = "dead"  # the engine is stopping
    FAILED = "failed"  # the engine can no longer step (a tensor-parallel rank died)


class EngineReady(_Message):
    config: Any  # EngineConfig
    main_cpu: int | None  # the CPU the engine's main thread is pinned to, if any
    warmup_steps: list[StepStats]  # the warm-up's measured steps (engine/warmup.py); none without it
    memory: Any = None  # MemoryReport (worker/memory_report.py): the loaded model's, for /server_info
    # why the engine is not batch invariant (worker/batch_invariance.py), for /server_info; (): it is
    batch_invariance: Any = None
    # the loaded LoRA adapters' prefix-cache keys by name (LLMEngine.lora_cache_keys), for /server_info
    lora_keys: Any = None


class EngineWarming(_Message):
    """The model is loaded and the engine warms up (engine/warmup.py); EngineReady follows."""


class EngineLoadFailed(_Message):
    error: BaseException


class EngineOutput(_Message):
    """A RequestOutput without its prompt, in delta form."""

    request_id: str
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None
    spec_decode: SpecDecodeStats | None
    completions: list[CompletionOutput]
    prompt_logprobs: PromptLogprobs | None = None  # with the first output of a request that asked
    embedding: list[float] | None = None  # a pooling request's one output

    @classmethod
    def of(cls, output: RequestOutput) -> EngineOutput:
        return cls(
            output.request_id,
            output.finished,
            output.num_cached_tokens,
            output.metrics,
            output.spec_decode,
            output.outputs,
            output.prompt_logprobs,
            output.embedding,
        )

    def to_request_output(self, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=self.completions,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            spec_decode=self.spec_decode,
            prompt_logprobs=self.prompt_logprobs,
            embedding=self.embedding,
        )


class StepOutputs(_Message):
    outputs: list[EngineOutput]
    stats: StepStats
    gauges: EngineGauges


class RequestAborted(_Message):
    request_id: str
    output: EngineOutput | None  # its final output, None if the engine no longer knew it
    gauges: EngineGauges


class RequestsFailed(_Message):
    request_ids: list[str]
    kind: FailureKind
    message: str


class EngineStatus(_Message):
    gauges: EngineGauges


class LoRACommandDone(_Message):
    command_id: str
    error: str | None  # why the engine refused the command; None: done
    cache_key: bytes = b""  # a loaded adapter's prefix-cache key (LoRAManager.cache_key)


EngineMessage = (
    EngineReady
    | EngineWarming
    | EngineLoadFailed
    | StepOutputs
    | RequestAborted
    | RequestsFailed
    | EngineStatus
    | LoRACommandDone
)
