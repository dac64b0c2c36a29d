"""Each model family next to a Llama of the same size: batch-1 decode and mixed-workload throughput.

    python -m benchmarks.tools.family_decode --workload bench_results/mixed-100.jsonl \
        [--families llama qwen3 phi3 gemma2 gemma3 mixtral] [--hidden 512] [--layers 8] \
        [--dtype bfloat16] [--passes 3]

Every family is a random checkpoint of the same shape (hidden size, layers, heads, MLP width; Mixtral
8 experts at top-2, so twice the active MLP), written with transformers' own classes to a temporary
directory and served by the default engine, one after the other in this process. Each prints one
JSON line (`ab_checkouts.measure`: best tok/s over the workload, batch-1 ms/token) with its ratio to
Llama's: a family that fell off the fast path (no compiled kernels, no fused decode stack) shows as a
larger ratio. Make the workload with `llmserve bench workload --out FILE --num-requests 100 --seed 0`;
run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile

FAMILIES = ("llama", "qwen3", "phi3", "gemma2", "gemma3", "mixtral")


def family_model(family: str, hidden: int, layers: int):
    """A random transformers model of `family` at the given size."""
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(partial_rotary_factor=0.75)),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(sliding_window=512)),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(sliding_window=512)),
        "mixtral": (
            transformers.MixtralConfig,
            transformers.MixtralForCausalLM,
            dict(num_local_experts=8, num_experts_per_tok=2),
        ),
    }
    config_cls, model_cls, extra = classes[family]
    return model_cls(config_cls(**common, **extra))


def measure_family(family: str, args: argparse.Namespace, requests) -> dict:
    import torch

    from benchmarks.tools.ab_checkouts import measure
    from llmserve import LLM
    from llmserve.model_loader import default_model_path, load_tokenizer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        family_model(family, args.hidden, args.layers).save_pretrained(path, safe_serialization=True)
        load_tokenizer(default_model_path()).hf.save_pretrained(path)
        llm = LLM(path, dtype=args.dtype, max_model_len=4096)
        try:
            return measure(llm, requests, passes=args.passes)
        finally:
            llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    from llmserve.benchmarks.workload import load_jsonl

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)
    requests = load_jsonl(args.workload)
    families = ["llama", *(f for f in args.families if f != "llama")]  # the baseline first
    baseline = None
    for family in families:
        result = measure_family(family, args, requests)
        baseline = baseline or result
        result["vs_llama"] = {
            "tok_s": result["tok_s"] / baseline["tok_s"],
            "b1_ms": result["b1_ms"] / baseline["b1_ms"],
        }
        print(json.dumps({"family": family, **result}), flush=True)


if __name__ == "__main__":
    main()
