"""A GPU's memory after the model loads, measured so that the KV pool can take what is left of
--gpu-memory-utilization (config: `gpu_kv_cache_memory`), as vLLM's profile run does.

The weights' bytes are what the device holds once the model is loaded; the activations' peak is that
of one real step of the largest shape the scheduler can plan (config: `profile_step_lengths`: the
step's token budget over max_num_seqs prompts, every row sampling with top-p, the sampler's costliest
path), run by a model runner of its own on a pool of that step's blocks only. Memory taken after the
profile (a draft model's weights, CUDA graphs) comes out of what the fraction leaves unused.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from llmserve.config import DeviceMemory, EngineConfig, profile_step_lengths
from llmserve.core.step_plan import NewRequestData, StepPlan
from llmserve.sampling_params import SamplingParams
from llmserve.worker.model_runner import ModelRunner

logger = logging.getLogger("llmserve")

_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=1)  # sorts the whole vocabulary


def profile_device_memory(config: EngineConfig, model: nn.Module) -> DeviceMemory:
    """The device's total and free memory, the loaded model's bytes and one profiled step's peak."""
    device = config.model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    runner = profile_runner(config, model)
    before = torch.cuda.memory_allocated(device)  # the weights and the profile's small pool
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(profile_plan(config))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    memory = DeviceMemory(total=total, free=free, weights=weights, peak_activations=peak)
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB free after loading; weights %.2f GiB, a step's peak "
        "activations %.2f GiB",
        *(value / 2**30 for value in (total, free, weights, peak)),
    )
    return memory


def profile_runner(config: EngineConfig, model: nn.Module) -> ModelRunner:
    """A runner of the profile's own: the config's pool (the profiling step's blocks), no swap space,
    no LoRA adapters (the engine's runner attaches them to the model once)."""
    cache = dataclasses.replace(config.cache, num_swap_blocks=0, kv_offloading=None)
    return ModelRunner(dataclasses.replace(config, cache=cache, lora=None), model)


def profile_plan(config: EngineConfig) -> StepPlan:
    """The profiling step: new prompts of `profile_step_lengths`, each on blocks of its own (every
    KV-cache group's column of a request's table on the same ones: only memory is measured)."""
    scheduler, cache = config.scheduler, config.cache
    lengths = profile_step_lengths(
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs, scheduler.max_model_len
    )
    groups = max(len(cache.kv_groups), 1)
    requests, next_block = [], 0
    for index, length in enumerate(lengths):
        blocks = range(next_block, next_block + -(-length // cache.block_size))
        next_block = blocks.stop
        table = [block for block in blocks for _ in range(groups)]
        requests.append(NewRequestData(f"profile-{index}", [0] * length, [], _PROFILE_SAMPLING, (), table, 0))
    return StepPlan(
        new_requests=requests,
        num_scheduled_tokens={request.request_id: len(request.prompt_token_ids) for request in requests},
    )
