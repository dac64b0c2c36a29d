"""A mixture-of-experts layer of Qwen3-30B-A3B's shapes next to a dense layer of the same active size.

    python -m benchmarks.tools.moe_layers [--depths 1 4] [--quantization int4 none] \
        [--concurrent 32] [--decode-tokens 64] [--repeats 3] [--rounds 1] [--expert-parallel 2] \
        [--all2all-backend naive all_to_all]

Qwen3-30B-A3B's decoder layer (hidden 2048, 32 query and 4 KV heads of 128, 128 experts of width
768, top 8, renormalized) in a random checkpoint written with transformers' Qwen3MoeForCausalLM, and
a dense Qwen3 layer with the same active parameters (MLP width 8 x 768 = 6144), both over the
default tokenizer's 49,152-token vocabulary. Each is written at two depths and served by the
default engine under each `--quantization`; a layer's batch-1 decode time is the difference of the
two depths' ms/token (median and fastest of all repeats of all `--rounds`; each round serves every
model once, so a drift of the machine reaches them alike) over the difference of their layer counts
(embedding, logits and sampling cancel). The deeper models also serve `--concurrent` requests at
once (128 prompt tokens, 128 generated), reported as total tok/s. One JSON line per (model, depth,
quantization), then one with the per-layer times and the MoE/dense ratio per quantization. With
`--expert-parallel 2` the deeper int4 MoE is also served on two ranks with its experts split
(`--enable-expert-parallel`), reporting beside the one-process run the decode step at
`--concurrent` sequences and the bytes the ranks' expert layers sent each other per step (their own
counts), once per `--all2all-backend`. The
checkpoints take 1.5 GB per layer in bf16 under a temporary directory (`--dir` to choose it); run
on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
)


def write_model(path: str, kind: str, layers: int) -> None:
    """A random bf16 checkpoint of Qwen3-30B-A3B's layer (`kind` "moe") or its dense twin ("dense")."""
    import torch
    import transformers

    from llmserve.model_loader import default_model_path, load_tokenizer

    torch.manual_seed(0)
    shape = QWEN3_30B_A3B
    common = dict(
        vocab_size=49152,
        hidden_size=shape["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    active = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=active,
            moe_intermediate_size=shape["moe_intermediate_size"],
            num_experts=shape["num_experts"],
            num_experts_per_tok=shape["num_experts_per_tok"],
            norm_topk_prob=True,
        )
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=active)
        model_cls = transformers.Qwen3ForCausalLM
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: float32 experts would double the peak
    try:
        model_cls(config).save_pretrained(path, safe_serialization=True)
    finally:
        torch.set_default_dtype(default)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)


def rank_totals(llm) -> tuple[int, int]:
    """(all-to-all bytes over the ranks, steps) from the ranks' reports, after one more step that
    makes each rank send a fresh one."""
    from llmserve import SamplingParams
    from llmserve.metrics.ranks import REPORT_INTERVAL_SECONDS

    time.sleep(REPORT_INTERVAL_SECONDS + 0.2)
    llm.generate([[100]], SamplingParams(max_tokens=1), use_tqdm=False)
    stats = llm.engine.rank_stats()
    return sum(rank.all_to_all_bytes for rank in stats), max(rank.num_steps for rank in stats)


def _decode_ms(output) -> float:
    """A request's time per generated token after its first."""
    metrics = output.metrics
    return 1e3 * (metrics.finished_time - metrics.first_token_time) / (len(output.outputs[0].token_ids) - 1)


def measure(
    path: str,
    quantization: str,
    args: argparse.Namespace,
    concurrent: bool,
    ranks: int = 1,
    all2all_backend: str = "naive",
) -> dict:
    from llmserve import LLM, SamplingParams

    start = time.perf_counter()
    parallel = (
        dict(tensor_parallel_size=ranks, enable_expert_parallel=True, all2all_backend=all2all_backend)
        if ranks > 1
        else {}
    )
    llm = LLM(path, quantization=quantization, max_model_len=1024, kv_cache_memory="1GiB", **parallel)
    result: dict = {"load_s": round(time.perf_counter() - start, 1)}
    try:
        one = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
        prompt = list(range(100, 116))
        llm.generate([prompt], one, use_tqdm=False)  # warm-up
        times = []
        for _ in range(args.repeats):
            (output,) = llm.generate([prompt], one, use_tqdm=False)
            times.append(_decode_ms(output))
        result["b1_ms"] = statistics.median(times)
        result["b1_min_ms"] = min(times)
        result["b1_all"] = [round(ms, 2) for ms in times]
        if concurrent:
            many = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
            prompts = [[100 + (7 * i + j) % 40000 for j in range(128)] for i in range(args.concurrent)]
            llm.generate(prompts[:2], many, use_tqdm=False)  # warm-up
            before = rank_totals(llm) if ranks > 1 else (0, 0)
            start = time.perf_counter()
            outputs = llm.generate(prompts, many, use_tqdm=False)
            seconds = time.perf_counter() - start
            result["concurrent"] = args.concurrent
            result["total_tok_s"] = round(args.concurrent * 256 / seconds, 1)
            # every request decodes in the same steps once the prompts are in: its time per token is
            # the step's at that batch
            step_ms = [
                1e3
                * (o.metrics.finished_time - o.metrics.first_token_time)
                / (len(o.outputs[0].token_ids) - 1)
                for o in outputs
            ]
            result["decode_step_ms"] = round(statistics.median(step_ms), 2)
            if ranks > 1:
                moved, steps = (after - first for after, first in zip(rank_totals(llm), before, strict=True))
                result["all_to_all_bytes_per_step"] = round(moved / steps)
    finally:
        llm.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs=2, default=[1, 4])
    parser.add_argument("--quantization", nargs="+", default=["int4", "none"])
    parser.add_argument("--kinds", nargs="+", choices=["moe", "dense"], default=["moe", "dense"])
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the temporary checkpoints go")
    parser.add_argument(
        "--expert-parallel", type=int, default=0, help="also serve the deeper int4 MoE on this many ranks"
    )
    parser.add_argument(
        "--all2all-backend",
        nargs="+",
        default=["naive"],
        choices=["naive", "all_to_all"],
        help="the expert-parallel runs' dispatch, each in turn",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="serve every model this many times, alternating them"
    )
    args = parser.parse_args(argv)
    shallow, deep = args.depths
    times: dict = {}  # (kind, layers, quantization) -> every batch-1 ms/token over the rounds
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        paths = {}
        for kind in args.kinds:
            for layers in (shallow, deep):
                paths[kind, layers] = f"{root}/{kind}-{layers}"
                write_model(paths[kind, layers], kind, layers)
        for round_index in range(args.rounds):
            for (kind, layers), path in paths.items():
                for quantization in args.quantization:
                    result = measure(path, quantization, args, concurrent=layers == deep)
                    times.setdefault((kind, layers, quantization), []).extend(result["b1_all"])
                    line = {
                        "round": round_index,
                        "model": kind,
                        "layers": layers,
                        "quantization": quantization,
                    }
                    print(json.dumps({**line, **result}), flush=True)
                for backend in args.all2all_backend if kind == "moe" and layers == deep else ():
                    if args.expert_parallel < 2:
                        break
                    result = measure(path, "int4", args, True, args.expert_parallel, backend)
                    line = {"round": round_index, "model": kind, "layers": layers, "quantization": "int4"}
                    parallel = {"expert_parallel": args.expert_parallel, "all2all_backend": backend}
                    print(json.dumps({**line, **result, **parallel}), flush=True)
    b1 = {key: (statistics.median(values), min(values)) for key, values in times.items()}
    summary = {}
    for stat, index in (("median", 0), ("min", 1)):  # the min: the runs least disturbed by the machine
        per_layer = {
            f"{kind}/{q}": (b1[kind, deep, q][index] - b1[kind, shallow, q][index]) / (deep - shallow)
            for kind in args.kinds
            for q in args.quantization
        }
        summary[f"per_layer_b1_ms_{stat}"] = {key: round(ms, 3) for key, ms in per_layer.items()}
        if set(args.kinds) == {"moe", "dense"}:
            summary[f"moe_vs_dense_{stat}"] = {
                q: round(per_layer[f"moe/{q}"] / per_layer[f"dense/{q}"], 3) for q in args.quantization
            }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
