"""`llmserve bench latency`: batch 1 prefill tokens/s and decode ms/token per prompt length, beside
the machine's bounds (memory bandwidth, matmul throughput)."""

from __future__ import annotations

import argparse
import dataclasses

from tqdm.auto import tqdm

from llmserve.benchmarks.commands.common import add_output_arguments, positive_ints, save
from llmserve.config import EngineArgs


def register(commands) -> None:
    parser = commands.add_parser("latency", help="batch 1: prefill tok/s, decode ms/token, hardware bounds")
    parser.add_argument("--prompt-lengths", type=positive_ints, default=[16, 128, 512, 1024])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt length (median reported)")
    parser.add_argument("--copy-mib", type=int, default=512, help="tensor size of the bandwidth test")
    parser.add_argument("--matmul-size", type=int, default=2048, help="N of the N x N matmul test")
    add_output_arguments(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=cmd_latency)


def cmd_latency(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.latency import format_report, measure_bounds, plot_latency, run_latency
    from llmserve.benchmarks.workload import TokenCorpus
    from llmserve.engine.llm_engine import LLMEngine

    # Prefix caching off: repeated runs must compute their whole prompt.
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), prefix_caching=False)
    engine = LLMEngine(engine_args)
    engine.model_runner.wait_for_kv_prefault()
    max_model_len = engine.config.model.max_model_len
    lengths = [n for n in args.prompt_lengths if n + args.decode_tokens + 1 <= max_model_len]
    skipped = sorted(set(args.prompt_lengths) - set(lengths))
    if skipped:
        print(
            f"skipping prompt lengths {skipped}: "
            f"no room for {args.decode_tokens} more tokens in max_model_len {max_model_len}"
        )
    if not lengths:
        raise ValueError("no prompt length fits; lower --decode-tokens or raise --max-model-len")
    with tqdm(total=len(lengths) * args.repeats, desc="latency", unit="run") as progress:
        points = run_latency(
            engine,
            TokenCorpus(engine.tokenizer),
            lengths,
            args.decode_tokens,
            args.repeats,
            args.seed,
            progress,
        )
    device = engine.config.model.device
    bounds = measure_bounds(
        engine.model_runner.model, device, args.copy_mib * 2**20, args.matmul_size, repeats=5
    )
    print(format_report(points, bounds))
    payload = {
        "engine_args": dataclasses.asdict(engine_args),
        "decode_tokens": args.decode_tokens,
        "points": [p.to_json() for p in points],
        "bounds": bounds.to_json(),
        # why outputs may depend on the batch (worker/batch_invariance.py); []: --deterministic holds
        "batch_invariance_reasons": list(engine.batch_invariance),
    }
    save(args, "latency", payload, device)
    if args.plot:
        plot_latency(points, bounds, args.plot)
    return 0
