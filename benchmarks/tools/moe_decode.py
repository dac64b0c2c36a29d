"""Batch-1 decode time of a random Mixtral as the expert count doubles at a fixed top-k.

    python -m benchmarks.tools.moe_decode [--experts 8 16] [--top-k 2] [--hidden 512] \
        [--intermediate 1024] [--layers 8] [--tokens 128] [--repeats 5] [--dtype bfloat16]

Routed experts run over only their tokens (models/layers/moe.py), so at batch 1 the step's work
follows top-k, not the expert count: doubling the experts should change ms/token by < 20% (the
remaining cost is the router's wider matmul and the larger weights' footprint). Each expert count
is a random checkpoint written with transformers' MixtralForCausalLM to a temporary directory and
served by the default engine; it prints one JSON line per count and the ratio of the last to the
first. Run it on a quiet machine: on a loaded one the spread of the runs exceeds the difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def write_mixtral(path: str, experts: int, args: argparse.Namespace) -> None:
    import torch
    import transformers

    from llmserve.model_loader import default_model_path, load_tokenizer

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        num_local_experts=experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    transformers.MixtralForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)


def decode_ms(path: str, args: argparse.Namespace) -> list[float]:
    from llmserve import LLM, SamplingParams

    llm = LLM(path, dtype=args.dtype, max_model_len=1024, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = list(range(100, 116))
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append((time.perf_counter() - start) * 1000 / args.tokens)
    llm.shutdown()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    medians = []
    for experts in args.experts:
        with tempfile.TemporaryDirectory() as path:
            write_mixtral(path, experts, args)
            times = decode_ms(path, args)
        medians.append(statistics.median(times))
        print(json.dumps({"experts": experts, "top_k": args.top_k, "b1_ms": medians[-1], "all": times}))
    print(json.dumps({"ratio_last_to_first": medians[-1] / medians[0]}))


if __name__ == "__main__":
    main()
