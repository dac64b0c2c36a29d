"""`llmserve bench serve`: load an OpenAI-compatible server at a request rate (or a sweep of rates)
and measure what a user sees: TTFT, time per output token, goodput under latency targets (vLLM's
`--goodput`); where the server has Prometheus prefix-cache counters (llmserve, vLLM, a router's per
replica), each run's hit rate too. A sweep of rates plots goodput against offered load."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path

from tqdm.auto import tqdm

from llmserve.benchmarks.commands.common import (
    add_output_arguments,
    add_workload_arguments,
    load_tokenizer_for,
    load_workload,
    save,
)
from llmserve.benchmarks.goodput import goodput_pair, goodput_targets
from llmserve.benchmarks.workload import BenchRequest, describe


def register(commands) -> None:
    parser = commands.add_parser("serve", help="online: load an OpenAI-compatible server, measure latency")
    parser.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000",
                        help="server base URL (any OpenAI-compatible server)")  # fmt: skip
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    parser.add_argument("--tokenizer", default=None, help="model dir/GGUF whose tokenizer draws the workload")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate, req/s (inf: all)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--sweep", "--request-rates", dest="sweep", type=rate_list, default=None,
                        metavar="RATES", help="several rates, one run each: 1,2,4,inf or "
                        "START:STOP:STEP (1:2:0.25 is 1,1.25,...,2), mixable: 0.5,1:2:0.25,inf")  # fmt: skip
    parser.add_argument("--goodput", nargs="+", type=goodput_pair, default=None, metavar="KEY:MS",
                        help="latency targets a request must all meet to count in request_goodput, as "
                        "vLLM: ttft:1000 tpot:50 (keys ttft, tpot, e2el; milliseconds); default "
                        "ttft:1000 tpot:50")  # fmt: skip
    parser.add_argument("--slo-ttft-ms", type=positive_ms, default=None, help="the same as --goodput ttft:MS")
    parser.add_argument("--slo-tpot-ms", type=positive_ms, default=None, help="the same as --goodput tpot:MS")
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                        help="send token ids (exact lengths, same tokenizer) or the prompt text")  # fmt: skip
    parser.add_argument("--cache-bust", action=argparse.BooleanOptionalAction, default=True,
                        help="put a random run-specific token before every prompt, so that no run "
                        "finds an earlier run's prompts in the server's prefix cache")  # fmt: skip
    parser.add_argument("--json-schema", default=None, metavar="FILE",
                        help="constrain every request's output to this JSON schema (response_format "
                        "json_schema): structured outputs' cost against a run without")  # fmt: skip
    add_workload_arguments(parser, with_seed=True)
    add_output_arguments(parser)
    parser.set_defaults(handler=cmd_serve)


def response_format_body(path: str | None) -> dict | None:
    """The request field that constrains the output to the JSON schema in `path`; None without one."""
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--json-schema {path}: {error}") from None
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}


def rate_list(text: str) -> list[float]:
    """Comma-separated rates and START:STOP:STEP ranges (STOP included), in order."""
    rates = []
    for item in filter(None, text.split(",")):
        try:
            parts = [float(part) for part in item.split(":")]  # float("inf") parses "inf"
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a rate or START:STOP:STEP") from None
        if len(parts) == 1:
            rates += parts
            continue
        if len(parts) != 3 or not all(map(math.isfinite, parts)) or parts[2] <= 0 or parts[1] < parts[0]:
            raise argparse.ArgumentTypeError(f"{item!r}: a range is START:STOP:STEP, finite, STEP > 0")
        start, stop, step = parts
        count = math.floor((stop - start) / step + 1e-9) + 1
        rates += [round(start + index * step, 9) for index in range(count)]
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {text!r}")
    return rates


def positive_ms(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of ms, got {text!r}")
    return value


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
    args.goodput = goodput_targets(args.goodput, {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms})
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
    from llmserve.benchmarks.prefix_hits import read_prefix_cache_counters
    from llmserve.benchmarks.serve import LoadGenerator, arrival_offsets, drawn_rate, summarize

    extra_body = response_format_body(args.json_schema)
    generator = LoadGenerator(
        url, model, rate, args.max_concurrency, args.seed, args.prompt_format, extra_body
    )
    before = read_prefix_cache_counters(url)
    with tqdm(total=len(requests), desc=f"rate {rate:g}/s", unit="req") as progress:
        cpu = time.process_time()
        request_results, duration = asyncio.run(generator.run(requests, progress))
        cpu = time.process_time() - cpu
    after = read_prefix_cache_counters(url)
    offered = drawn_rate(arrival_offsets(len(requests), rate, args.seed))
    metrics = summarize(request_results, duration, args.goodput, client_cpu_seconds=cpu, offered_rate=offered)
    if before is not None and after is not None:
        metrics = dataclasses.replace(metrics, prefix_cache=after.minus(before).to_json())
    return metrics, request_results
