"""LoRA adapters against the base model alone: all at once, batch 1, and an adapter's load time.

    python -m benchmarks.tools.lora_adapters --workload bench_results/mixed-100.jsonl \
        [--adapters 8] [--rank 16] [--rounds 2] [--model M] [--output F]

Writes --adapters random PEFT adapters of rank --rank over every linear layer of the model
(`q/k/v/o_proj`, `gate/up/down_proj`, PEFT's file layout) into a temporary directory, then in one
process, alternating base and LoRA runs --rounds times:
- all at once: every request of the workload added at once (greedy, `ignore_eos`), total tokens per
  second; the LoRA engine (`--enable-lora --max-loras <adapters>`) gives request i adapter i mod N;
- batch 1: one 128-token prompt decoding 64 tokens, ms per generated token after the first, base
  against the same request under one adapter;
- load: `engine.add_lora` of a fresh rank-R adapter between steps (read, checked, kept in host
  memory and written into a slot, the least recently used adapter's), medians of 5; beside it a
  16-token prompt's step under the new adapter and under none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmserve.benchmarks.results import run_metadata, write_result
from llmserve.benchmarks.workload import load_jsonl
from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.sampling_params import SamplingParams

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(path: Path, arch, rank: int, seed: int) -> str:
    """A random PEFT adapter (B non-zero, small) over every linear layer of `arch`."""
    generator = torch.Generator().manual_seed(seed)
    hidden, heads = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    shapes = {  # module -> (in, out)
        "q_proj": (hidden, heads),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads, hidden),
        "gate_proj": (hidden, arch.intermediate_size),
        "up_proj": (hidden, arch.intermediate_size),
        "down_proj": (arch.intermediate_size, hidden),
    }
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for block, modules in TARGETS.items():
            for module in modules:
                fan_in, fan_out = shapes[module]
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [m for modules in TARGETS.values() for m in modules],
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def all_at_once(engine: LLMEngine, workload, adapters: list[str]) -> float:
    """Total tokens per second of the workload added at once; request i under adapters[i % N]."""
    tokens = 0
    for index, request in enumerate(workload):
        lora = adapters[index % len(adapters)] if adapters else None
        params = SamplingParams(
            temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True, lora_name=lora
        )
        engine.add_request(f"r{index}", request.prompt_token_ids, params)
        tokens += len(request.prompt_token_ids) + request.max_tokens
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - start)


def batch_one(engine: LLMEngine, adapter: str | None, prompt: list[int], tokens: int = 64) -> float:
    """ms per generated token after the first, one request alone."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, lora_name=adapter)
    engine.add_request("b1", prompt, params)
    engine.step()  # the prefill and first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * (time.perf_counter() - start) / (tokens - 1)


def load_times(engine: LLMEngine, directory: Path, arch, rank: int, prompt: list[int]) -> dict:
    """Seconds of add_lora and of the first step under the new adapter (its slot write), medians of 5;
    a step without it beside, for the difference."""
    adds, first_steps, plain_steps = [], [], []
    for index in range(5):
        path = write_adapter(directory / f"load{index}", arch, rank, seed=1000 + index)
        start = time.perf_counter()
        engine.add_lora(f"load{index}", path)
        adds.append(time.perf_counter() - start)
        for name, times in ((None, plain_steps), (f"load{index}", first_steps)):
            params = SamplingParams(temperature=0.0, max_tokens=1, lora_name=name)
            engine.add_request(f"l{index}{name}", prompt[:16], params)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - start)
        engine.remove_lora(f"load{index}")
    return {
        "add_lora_ms": 1e3 * statistics.median(adds),
        "first_step_ms": 1e3 * statistics.median(first_steps),
        "plain_step_ms": 1e3 * statistics.median(plain_steps),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    workload = load_jsonl(args.workload)
    common = dict(model=args.model, prefix_caching=False)
    base = LLMEngine(EngineArgs(**common))
    arch = base.config.model.arch
    prompt = list(range(1000, 1128))
    results: dict = {**run_metadata("lora_adapters"), "rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        names = [f"a{i}" for i in range(args.adapters)]
        modules = [
            f"{n}={write_adapter(directory / n, arch, args.rank, seed=i)}" for i, n in enumerate(names)
        ]
        lora = LLMEngine(
            EngineArgs(
                **common,
                enable_lora=True,
                lora_modules=tuple(modules),
                max_loras=args.adapters,
                max_lora_rank=args.rank,
            )
        )
        all_at_once(lora, workload[:8], names)  # every adapter into its slot before timing
        for round_index in range(args.rounds):
            row = {
                "base_tok_s": all_at_once(base, workload, []),
                "lora_tok_s": all_at_once(lora, workload, names),
                "base_b1_ms": batch_one(base, None, prompt),
                "lora_b1_ms": batch_one(lora, names[0], prompt),
                "lora_engine_base_b1_ms": batch_one(lora, None, prompt),
            }
            row["all_at_once_ratio"] = row["lora_tok_s"] / row["base_tok_s"]
            row["batch1_ratio"] = row["lora_b1_ms"] / row["base_b1_ms"]
            results["rounds"].append(row)
            print(
                f"round {round_index + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True
            )
        results["load"] = load_times(lora, directory, arch, args.rank, prompt)
    print("load: " + "  ".join(f"{k} {v:.1f}" for k, v in results["load"].items()))
    results.update(
        adapters=args.adapters, rank=args.rank, model=arch.architecture, dtype=str(base.config.model.dtype)
    )
    if args.output:
        write_result(args.output, results)


if __name__ == "__main__":
    main()
