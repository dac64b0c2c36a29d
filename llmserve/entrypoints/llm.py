"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import numbers
import weakref
from collections.abc import Sequence
from dataclasses import replace

from tqdm.auto import tqdm

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.lora.request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | Sequence[int]
# vLLM's TextPrompt and TokensPrompt dicts: the one key each may hold
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Runs a batch of prompts through the engine with continuous batching and returns their outputs.

    `model=None` serves the embedded default model (SmolLM2-135M-Instruct). Other keyword arguments
    are `EngineArgs` fields (dtype, kv_cache_memory, max_model_len, max_num_batched_tokens, ...).

    Its tensor- or pipeline-parallel ranks stop, and their process group is left, at `shutdown()`,
    at the end of a `with LLM(...) as llm:` block, when the object is deleted or collected, or at
    exit, whichever comes first: after that this process can start another parallel engine.
    """

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # holds the engine, not this object: it runs once, when this object goes or at shutdown()
        self._release = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's parallel ranks and leave their process group (once; later calls do nothing)."""
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.
        `lora_request` (vLLM's): the LoRA adapter of every prompt or of each, loaded on first use."""
        if not self._release.alive:
            raise RuntimeError("this LLM was shut down")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if lora_request is not None:
            params = self._with_adapters(params, lora_request)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        request_ids: list[str] = []
        try:
            for prompt, param, prio in zip(prompts, params, priorities, strict=True):
                request_id = str(next(self._ids))
                # only finished outputs are returned: one per request, built once
                final = param.with_output_kind(RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, final, priority=prio)
                request_ids.append(request_id)
        except Exception:  # a bad prompt or parameter: none of this call's requests stays queued
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def _with_adapters(self, params: list[SamplingParams], requests) -> list[SamplingParams]:
        """Each prompt's parameters naming its adapter, loading the adapters not loaded yet."""
        requests = [requests] * len(params) if isinstance(requests, LoRARequest) else list(requests)
        if len(requests) != len(params):
            raise ValueError(f"got {len(requests)} LoRA requests for {len(params)} prompts")
        lora = self.engine.model_runner.lora
        for request in {r.lora_name: r for r in requests if r is not None}.values():
            if lora is None or request.lora_name not in lora.adapters:
                self.engine.add_lora(request.lora_name, request.lora_path)  # refused with LoRA off
        pairs = zip(params, requests, strict=True)
        return [p if r is None else replace(p, lora_name=r.lora_name) for p, r in pairs]

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (a list of role/content messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str | dict) or getattr(prompts, "ndim", None) == 1:  # one prompt (ids: an array)
        return [_as_prompt(prompts)]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], numbers.Integral):
        return [prompts]  # a single prompt given as token ids
    return [_as_prompt(prompt) for prompt in prompts]


def _as_prompt(prompt) -> Prompt:
    """A prompt as text or token ids; vLLM's {"prompt": text} and {"prompt_token_ids": ids} too."""
    if not isinstance(prompt, dict):
        return prompt
    if len(prompt) != 1 or next(iter(prompt)) not in _PROMPT_KEYS:
        raise ValueError(
            f"a prompt dict holds one of the keys {', '.join(_PROMPT_KEYS)}; got {sorted(prompt)}"
        )
    key, value = next(iter(prompt.items()))
    if (key == "prompt") != isinstance(value, str):
        raise ValueError(f"a prompt dict's {key!r} is {'text' if key == 'prompt' else 'a list of token ids'}")
    return value


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
