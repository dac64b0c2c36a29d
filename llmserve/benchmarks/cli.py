"""`llmserve bench throughput|serve|latency|memory|workload|prefix-cache|priority|spec-decode`.

Each command prints a report, writes a JSON result (with machine, command, date and commit) to
`--output` (default under bench_results/), and draws a PNG with `--plot`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tqdm.auto import tqdm

from llmserve.benchmarks import results as result_files
from llmserve.benchmarks.workload import BenchRequest, WorkloadSpec, build_workload, describe, load_jsonl
from llmserve.entrypoints.cli import add_engine_arguments, engine_args_from

T = TypeVar("T")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, latency, memory, workload")
    commands = bench.add_subparsers(dest="benchmark", required=True, parser_class=type(bench))
    _add_throughput(commands)
    _add_serve(commands)
    _add_latency(commands)
    _add_memory(commands)
    _add_workload(commands)
    _add_prefix_cache(commands)
    _add_priority(commands)
    _add_spec_decode(commands)


# -- argument groups --------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def _positive_ints(text: str) -> list[int]:
    values = _int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _batch_sizes(text: str) -> list[int]:
    """Naive batch sizes, or "none" for the continuous engine alone."""
    return [] if text.strip().lower() == "none" else _positive_ints(text)


def _rate_list(text: str) -> list[float]:
    return [float(item) for item in text.split(",") if item]  # float("inf") parses "inf"


def add_workload_arguments(parser: argparse.ArgumentParser, with_seed: bool, from_file: bool = True) -> None:
    """Workload flags; commands with engine flags share the engine's --seed as the workload seed."""
    group = parser.add_argument_group("workload")
    if from_file:
        group.add_argument(
            "--workload", default=None, help="JSONL file of requests; the flags below then do nothing"
        )
    group.add_argument("--num-requests", type=int, default=100)
    if with_seed:
        group.add_argument("--seed", type=int, default=0, help="workload seed")
    group.add_argument("--prompt-len-median", type=float, default=200.0)
    group.add_argument("--output-len-median", type=float, default=120.0)
    group.add_argument("--len-sigma", type=float, default=0.6, help="sigma of log(length), both lengths")
    group.add_argument("--prompt-len-range", type=_int_list, default=[4, 1024], help="MIN,MAX prompt tokens")
    group.add_argument("--output-len-range", type=_int_list, default=[4, 512], help="MIN,MAX output tokens")
    group.add_argument("--fixed-prompt-len", type=int, default=None, help="every prompt this long")
    group.add_argument("--fixed-output-len", type=int, default=None, help="every output this long")
    group.add_argument("--shared-prefixes", type=int, default=0, help="K system prompts shared by requests")
    group.add_argument("--prefix-len", type=int, default=500, help="tokens of each shared system prompt")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    for name in ("prompt_len_range", "output_len_range"):
        bounds = getattr(args, name)
        if len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"--{name.replace('_', '-')} takes MIN,MAX with 1 <= MIN <= MAX")
    return WorkloadSpec(
        num_requests=args.num_requests,
        seed=args.seed,
        prompt_len_median=args.prompt_len_median,
        output_len_median=args.output_len_median,
        sigma=args.len_sigma,
        prompt_len_range=tuple(args.prompt_len_range),
        output_len_range=tuple(args.output_len_range),
        fixed_prompt_len=args.fixed_prompt_len,
        fixed_output_len=args.fixed_output_len,
        shared_prefixes=args.shared_prefixes,
        prefix_len=args.prefix_len,
    )


def load_workload(args: argparse.Namespace, get_tokenizer: Callable) -> list[BenchRequest]:
    """The --workload file, or one drawn from the flags (the tokenizer is loaded only if needed)."""
    if getattr(args, "workload", None):
        return load_jsonl(args.workload, tokenizer=None if _file_has_ids(args.workload) else get_tokenizer())
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    return build_workload(workload_spec(args), get_tokenizer())


def _file_has_ids(path: str) -> bool:
    with open(path) as lines:
        return all('"prompt_token_ids"' in line for line in lines if line.strip())


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument(
        "--output", default=None, help="JSON result file (default: bench_results/NAME-TIME.json)"
    )
    group.add_argument("--plot", default=None, help="also draw a PNG here")


def save(args: argparse.Namespace, name: str, payload: dict, device=None) -> None:
    path = result_files.write_result(
        args.output or result_files.default_output_path(name),
        {**result_files.run_metadata(name, device), **payload},
    )
    print(f"result: {path}")


def load_tokenizer_for(model: str | None):
    from llmserve.model_loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model))


# -- throughput -------------------------------------------------------------------------------------


def _add_throughput(commands) -> None:
    parser = commands.add_parser("throughput", help="offline: naive request-level batching vs continuous")
    parser.add_argument(
        "--naive-batch-sizes",
        type=_batch_sizes,
        default=[8, 16, 32],
        help="e.g. 8,16,32; none: the continuous engine only",
    )
    parser.add_argument(
        "--engine-thread",
        action="store_true",
        help="step the engine in a background thread, as `llmserve serve` does (torch's threads and the "
        "OS treat the main thread's work differently: this separates that from the HTTP cost)",
    )
    add_workload_arguments(parser, with_seed=False)
    add_output_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(handler=cmd_throughput)


def cmd_throughput(args: argparse.Namespace) -> int:
    from llmserve import LLM
    from llmserve.benchmarks.throughput import format_report, plot_throughput, run_throughput, speedup

    engine_args = engine_args_from(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    llm.engine.model_runner.wait_for_kv_prefault()
    requests = load_workload(args, lambda: llm.tokenizer)
    run = in_thread if args.engine_thread else _call
    continuous, naive = run(run_throughput, llm, requests, args.naive_batch_sizes)
    print(format_report(continuous, naive))
    ratio, best = speedup(continuous, naive) if naive else (None, None)
    payload = {
        "workload": {"file": args.workload, **describe(requests)},
        "engine_args": dataclasses.asdict(engine_args),
        "engine_thread": args.engine_thread,
        "results": [r.to_json() for r in (*naive, continuous)],
        "speedup_vs_best_naive": ratio,
        "best_naive": best and best.system,
    }
    save(args, "throughput", payload, llm.engine.config.model.device)
    if args.plot:
        plot_throughput(continuous, naive, args.plot)
    return 0


def _call(function: Callable[..., T], *args) -> T:
    return function(*args)


def in_thread(function: Callable[..., T], *args) -> T:
    """`function(*args)` run in a new thread (its exception re-raised here)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmserve-engine") as pool:
        return pool.submit(function, *args).result()


# -- serve ------------------------------------------------------------------------------------------


def _add_serve(commands) -> None:
    parser = commands.add_parser("serve", help="online: load an OpenAI-compatible server, measure latency")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    parser.add_argument("--tokenizer", default=None, help="model dir/GGUF whose tokenizer draws the workload")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate, req/s (inf: all)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--sweep", type=_rate_list, default=None, help="several rates, e.g. 1,2,4,8,inf")
    parser.add_argument("--slo-ttft-ms", type=float, default=300.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                        help="send token ids (exact lengths, same tokenizer) or the prompt text")  # fmt: skip
    parser.add_argument("--cache-bust", action=argparse.BooleanOptionalAction, default=True,
                        help="put a random run-specific token before every prompt, so that no run "
                        "finds an earlier run's prompts in the server's prefix cache")  # fmt: skip
    add_workload_arguments(parser, with_seed=True)
    add_output_arguments(parser)
    parser.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import httpx

    from llmserve.benchmarks.serve import (
        format_report,
        pick_salts,
        plot_distributions,
        plot_sweep,
        salt_requests,
        served_model_name,
    )

    url = args.url.rstrip("/")
    try:
        model = args.model or served_model_name(url)
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach an OpenAI-compatible server at {url}: {error}") from error
    requests = load_workload(args, lambda: load_tokenizer_for(args.tokenizer))
    rates = args.sweep or [args.request_rate]
    salts = pick_salts(requests, len(rates)) if args.cache_bust else [None] * len(rates)
    runs = [
        _serve_once(
            args, url, model, requests if salt is None else salt_requests(requests, salt, f"{salt} "), rate
        )
        for rate, salt in zip(rates, salts, strict=True)
    ]
    for rate, (metrics, _) in zip(rates, runs, strict=True):
        print(format_report(metrics, label=f"[rate {rate:g}/s] "), end="\n\n")
    payload = {
        "url": url,
        "model": model,
        "workload": {"file": args.workload, **describe(requests)},
        "max_concurrency": args.max_concurrency,
        "cache_bust_salt_token_ids": salts if args.cache_bust else None,
        "runs": [
            {"request_rate": rate if math.isfinite(rate) else "inf", **metrics.to_json()}  # JSON has no inf
            for rate, (metrics, _) in zip(rates, runs, strict=True)
        ],
    }
    save(args, "serve", payload)
    if args.plot and len(runs) > 1:
        plot_sweep(rates, [metrics for metrics, _ in runs], args.plot)
    elif args.plot:
        plot_distributions(runs[0][1], args.plot)
    return 0


def _serve_once(args: argparse.Namespace, url: str, model: str, requests: list[BenchRequest], rate: float):
    from llmserve.benchmarks.serve import LoadGenerator, summarize

    generator = LoadGenerator(url, model, rate, args.max_concurrency, args.seed, args.prompt_format)
    with tqdm(total=len(requests), desc=f"rate {rate:g}/s", unit="req") as progress:
        cpu = time.process_time()
        request_results, duration = asyncio.run(generator.run(requests, progress))
        cpu = time.process_time() - cpu
    metrics = summarize(request_results, duration, args.slo_ttft_ms, args.slo_tpot_ms, client_cpu_seconds=cpu)
    return metrics, request_results


# -- latency ----------------------------------------------------------------------------------------


def _add_latency(commands) -> None:
    parser = commands.add_parser("latency", help="batch 1: prefill tok/s, decode ms/token, hardware bounds")
    parser.add_argument("--prompt-lengths", type=_positive_ints, default=[16, 128, 512, 1024])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt length (median reported)")
    parser.add_argument("--copy-mib", type=int, default=512, help="tensor size of the bandwidth test")
    parser.add_argument("--matmul-size", type=int, default=2048, help="N of the N x N matmul test")
    add_output_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(handler=cmd_latency)


def cmd_latency(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.latency import format_report, measure_bounds, plot_latency, run_latency
    from llmserve.benchmarks.workload import TokenCorpus
    from llmserve.engine.llm_engine import LLMEngine

    # Prefix caching off: repeated runs must compute their whole prompt.
    engine_args = dataclasses.replace(engine_args_from(args), prefix_caching=False)
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
    }
    save(args, "latency", payload, device)
    if args.plot:
        plot_latency(points, bounds, args.plot)
    return 0


# -- memory -----------------------------------------------------------------------------------------


def _add_memory(commands) -> None:
    parser = commands.add_parser("memory", help="sequences that fit a KV budget: paged vs contiguous")
    parser.add_argument("--live", action="store_true", help="also run the engine at that budget, sampling it")
    parser.add_argument("--live-requests", type=int, default=200, help="the first N requests run live")
    add_workload_arguments(parser, with_seed=False)
    add_output_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(handler=cmd_memory, kv_cache_memory="256MiB")
    # Enough requests to fill the default budget several times over.
    parser.set_defaults(num_requests=1000)


def cmd_memory(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.memory import plot_allocations, simulate
    from llmserve.benchmarks.throughput import check_fits
    from llmserve.model_loader import load_arch_config, load_tokenizer, resolve_model_path

    engine_args = engine_args_from(args)
    path = resolve_model_path(engine_args.model)
    config = engine_args.create_config(load_arch_config(path), path)
    requests = load_workload(args, lambda: load_tokenizer(path))
    check_fits(requests, config.model.max_model_len)
    cache = config.cache
    allocations = simulate(
        requests, cache.num_blocks * cache.block_size, cache.block_size, config.model.max_model_len
    )
    print(_memory_report(allocations, cache, len(requests)))
    payload = {
        "engine_args": dataclasses.asdict(engine_args),
        "kv_cache_bytes": cache.kv_cache_memory,
        "num_blocks": cache.num_blocks,
        "block_size": cache.block_size,
        "workload": {"file": args.workload, **describe(requests)},
        "allocations": [a.to_json() for a in allocations],
    }
    if args.live:
        payload["live"] = _measure_live(engine_args, requests[: args.live_requests])
    save(args, "memory", payload)
    if args.plot:
        plot_allocations(allocations, f"{cache.kv_cache_memory / 2**20:.0f} MiB", args.plot)
    return 0


def _memory_report(allocations, cache, num_requests: int) -> str:
    rows = [a.to_json() for a in allocations]
    table = result_files.format_table(rows, ("strategy", "concurrent_sequences", "allocated_slots", "waste"))
    paged, *contiguous = allocations
    ratios = ", ".join(f"{paged.concurrent_sequences / max(c.concurrent_sequences, 1):.1f}x {c.strategy}"
                       for c in contiguous)  # fmt: skip
    note = " (every request fits: use more requests)" if paged.concurrent_sequences == num_requests else ""
    return (
        f"KV budget {cache.kv_cache_memory / 2**20:.1f} MiB = {cache.num_blocks} blocks x {cache.block_size} "
        f"tokens\n{table}\npaged fits {ratios}{note}"
    )


def _measure_live(engine_args, requests: list[BenchRequest]) -> dict:
    from llmserve.benchmarks.memory import live_engine_args, measure_live
    from llmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(live_engine_args(engine_args, len(requests)))
    engine.model_runner.wait_for_kv_prefault()
    with tqdm(total=len(requests), desc="live", unit="req") as progress:
        live = measure_live(engine, requests, progress)
    print(
        f"live engine: at most {live.max_running} running at once (mean {live.mean_running:.1f}), "
        f"mean waste {100 * live.mean_waste:.1f}%, {live.num_preemptions} preemptions"
    )
    return dataclasses.asdict(live)


# -- workload ---------------------------------------------------------------------------------------


def _add_workload(commands) -> None:
    parser = commands.add_parser("workload", help="write a workload JSONL that any system can replay")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--tokenizer", default=None, help="model dir/GGUF whose tokenizer counts tokens")
    add_workload_arguments(parser, with_seed=True, from_file=False)
    parser.set_defaults(handler=cmd_workload)


def cmd_workload(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.workload import save_jsonl

    requests = load_workload(args, lambda: load_tokenizer_for(args.tokenizer))
    path = save_jsonl(requests, Path(args.out))
    stats = describe(requests)
    print(f"wrote {path}: " + ", ".join(f"{key} {value:g}" for key, value in stats.items()))
    return 0


# -- prefix cache -------------------------------------------------------------------------------------


def _add_prefix_cache(commands) -> None:
    parser = commands.add_parser(
        "prefix-cache", help="TTFT with a cached long prefix; shared-prefix throughput"
    )
    parser.add_argument(
        "--prefix-len", type=int, default=1000, help="tokens of the cached prefix (TTFT test)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="cold/warm TTFT pairs, each a fresh prefix")
    parser.add_argument(
        "--shared-prefixes", type=int, default=8, help="system prompts of the throughput test"
    )
    parser.add_argument("--shared-prefix-len", type=int, default=500)
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the throughput test")
    add_output_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(handler=cmd_prefix_cache)


def cmd_prefix_cache(args: argparse.Namespace) -> int:
    from llmserve import LLM
    from llmserve.benchmarks.prefix_cache import measure_throughput, measure_ttft
    from llmserve.benchmarks.workload import TokenCorpus

    engine_args = engine_args_from(args)
    cached = LLM(**{**dataclasses.asdict(engine_args), "prefix_caching": True})
    cached.engine.model_runner.wait_for_kv_prefault()
    corpus = TokenCorpus(cached.tokenizer)
    ttft = measure_ttft(cached, corpus, args.prefix_len, args.repeats, args.seed)
    summary = ttft.to_json()
    print(
        f"TTFT with a {args.prefix_len}-token prefix (batch 1, median of {args.repeats}): "
        f"cold {summary['cold_ttft_ms_median']:.1f} ms, cached {summary['warm_ttft_ms_median']:.1f} ms, "
        f"{ttft.speedup:.1f}x lower"
    )
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        seed=args.seed,
        shared_prefixes=args.shared_prefixes,
        prefix_len=args.shared_prefix_len,
    )
    requests = build_workload(spec, cached.tokenizer, corpus)
    with_cache = measure_throughput(cached, requests)
    del cached
    uncached = LLM(**{**dataclasses.asdict(engine_args), "prefix_caching": False})
    uncached.engine.model_runner.wait_for_kv_prefault()
    without_cache = measure_throughput(uncached, requests)
    rows = [r.to_json() for r in (without_cache, with_cache)]
    print(
        result_files.format_table(
            rows, ["prefix_caching", "seconds", "total_tokens_per_s", "cached_prompt_tokens"]
        )
    )
    ratio = with_cache.to_json()["total_tokens_per_s"] / without_cache.to_json()["total_tokens_per_s"]
    print(f"shared-prefix throughput with the cache: {ratio:.2f}x")
    payload = {
        "ttft": summary,
        "throughput": rows,
        "throughput_ratio": ratio,
        "workload": describe(requests),
        "engine_args": dataclasses.asdict(engine_args),
    }
    save(args, "prefix-cache", payload, uncached.engine.config.model.device)
    return 0


# -- priority -----------------------------------------------------------------------------------------


def _add_priority(commands) -> None:
    parser = commands.add_parser("priority", help="interactive TTFT under a batch flood: priority vs FCFS")
    parser.add_argument("--batch-requests", type=int, default=64, help="the flood (priority 1), all at t=0")
    parser.add_argument("--batch-prompt-len", type=int, default=400)
    parser.add_argument("--batch-output-len", type=int, default=150)
    parser.add_argument("--interactive-requests", type=int, default=30, help="Poisson stream (priority 0)")
    parser.add_argument("--interactive-prompt-len", type=int, default=40)
    parser.add_argument("--interactive-output-len", type=int, default=16)
    parser.add_argument("--rate", type=float, default=2.0, help="interactive arrivals per second")
    add_output_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(handler=cmd_priority)


def cmd_priority(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.priority import run_timeline, summarize, timeline
    from llmserve.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args)
    rows = []
    for policy in ("fcfs", "priority"):
        engine = LLMEngine(dataclasses.replace(engine_args, scheduling_policy=policy))
        engine.model_runner.wait_for_kv_prefault()
        batch = build_workload(
            WorkloadSpec(
                num_requests=args.batch_requests,
                seed=args.seed,
                fixed_prompt_len=args.batch_prompt_len,
                fixed_output_len=args.batch_output_len,
            ),
            engine.tokenizer,
        )
        interactive = build_workload(
            WorkloadSpec(
                num_requests=args.interactive_requests,
                seed=args.seed + 1,
                fixed_prompt_len=args.interactive_prompt_len,
                fixed_output_len=args.interactive_output_len,
            ),
            engine.tokenizer,
        )
        engine.add_request("warm-up", interactive[0].prompt_token_ids[:8])
        while engine.has_unfinished_requests():
            engine.step()
        ttft = run_timeline(engine, timeline(batch, interactive, args.rate, args.seed))
        rows.append(
            {
                "policy": policy,
                **{f"interactive_{k}": v for k, v in summarize(ttft[0]).items()},
                **{f"batch_{k}": v for k, v in summarize(ttft[1]).items()},
                "preemptions": engine.scheduler.num_preemptions,
            }
        )
        device = engine.config.model.device
        del engine
    print(
        result_files.format_table(
            rows, ["policy", "interactive_p50_ms", "interactive_p99_ms", "batch_p50_ms", "preemptions"]
        )
    )
    ratio = rows[0]["interactive_p99_ms"] / rows[1]["interactive_p99_ms"]
    print(f"interactive TTFT p99: priority scheduling is {ratio:.1f}x lower than FCFS")
    save(
        args,
        "priority",
        {"rows": rows, "p99_ratio": ratio, "engine_args": dataclasses.asdict(engine_args)},
        device,
    )
    return 0


# -- speculative decoding -----------------------------------------------------------------------------


def _add_spec_decode(commands) -> None:
    parser = commands.add_parser(
        "spec-decode", help="batch-1 ms/token per speculative method; throughput off / on / auto"
    )
    parser.add_argument(
        "--methods",
        default="ngram,early_exit",
        help="besides none: ngram,early_exit,draft,draft_head,draft_head_only",
    )
    parser.add_argument(
        "--early-exit-layers", type=_positive_ints, default=None, help="early-exit depths, e.g. 8,12,16"
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per latency workload")
    parser.add_argument("--document-len", type=int, default=400, help="tokens of each grounded document")
    parser.add_argument("--max-tokens", type=int, default=128, help="latency: tokens at most (EOS ends)")
    parser.add_argument("--batch-sizes", type=_positive_ints, default=[1, 4, 16, 64])
    parser.add_argument("--throughput-output-len", type=int, default=128, help="tokens per request")
    parser.add_argument("--throughput-repeats", type=int, default=3, help="waves per batch size and mode")
    parser.add_argument("--throughput-method", default="ngram", help="method measured on/auto ('' skips)")
    add_output_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(handler=cmd_spec_decode)


def cmd_spec_decode(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.spec_decode import (
        LATENCY_COLUMNS,
        THROUGHPUT_COLUMNS,
        SpecBenchConfig,
        methods,
        run_benchmark,
    )

    for name in ("num_prompts", "document_len", "max_tokens", "throughput_output_len", "throughput_repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    engine_args = engine_args_from(args)
    names = [n for n in args.methods.split(",") if n]
    if args.speculative_draft_model and "draft" not in names:
        names.append("draft")
    chosen = methods(names, args.early_exit_layers or [None], args.speculative_draft_model)
    if args.throughput_method and args.throughput_method not in {m.name for m in chosen}:
        raise ValueError(f"--throughput-method {args.throughput_method!r} is not among the methods measured")
    config = SpecBenchConfig(
        methods=tuple(chosen),
        throughput_method=args.throughput_method,
        num_prompts=args.num_prompts,
        document_len=args.document_len,
        max_tokens=args.max_tokens,
        batch_sizes=tuple(args.batch_sizes),
        throughput_output_len=args.throughput_output_len,
        throughput_repeats=args.throughput_repeats,
        seed=args.seed,
    )
    payload = run_benchmark(engine_args, config)
    print(result_files.format_table(payload["latency"], LATENCY_COLUMNS))
    if payload["throughput"]:
        print(result_files.format_table(payload["throughput"], THROUGHPUT_COLUMNS))
    save(args, "spec-decode", {**payload, "engine_args": dataclasses.asdict(engine_args)})
    return 0
