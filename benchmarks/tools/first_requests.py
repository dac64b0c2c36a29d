"""The first requests after /health against the same requests a minute later, with and without speculation.

    python -m benchmarks.tools.first_requests [--configs none,ngram,draft_head] \
        [--serve-seconds 60] [--lengths 64,128,...] [--server-args "--max-model-len 4096"] \
        [--output bench_results/first-requests.json]

For each configuration (`none`: no speculation, else a `--speculative-method`) a fresh
`llmserve serve` is started and timed from launch to its /health answering 200 (polled every 0.2 s);
then, one at a time, one streamed request per prompt length (distinct prompts of corpus text, each
with a first token no other prompt of the run has, so no prefix-cache hits): the *first* requests.
The server then keeps serving such requests, one at a time, for `--serve-seconds`, and the same
lengths are sent once more with new prompts: the *later* requests. Reported per configuration: the
start-up seconds, the first and later requests' TTFT median and p90 and their ratios (issue: within
1.2); and each speculative configuration's first-request TTFT against `none`'s (issue: within 1.1).
Run it on an otherwise idle machine; servers run one at a time.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from benchmarks.tools.side_by_side import _stop, llmserve_command, wait_for_health
from llmserve.benchmarks.results import format_table, run_metadata, write_result
from llmserve.benchmarks.workload import TokenCorpus
from llmserve.model_loader import load_tokenizer, resolve_model_path

DEFAULT_LENGTHS = "64,128,192,256,384,512,768,1024,1149,1536"  # ten shapes, up to a 1,536-token prompt


@dataclass
class ConfigResult:
    """One configuration's server: start-up seconds and the TTFTs (seconds) of its two rounds."""

    config: str
    server_command: str
    startup_seconds: float
    first_ttft: list[float]
    later_ttft: list[float]
    served_between: int = 0  # requests completed during the serving period
    summary: dict = field(default_factory=dict)

    def summarize(self) -> None:
        first, later = _stats(self.first_ttft), _stats(self.later_ttft)
        self.summary = {
            "first_median_ms": first[0],
            "first_p90_ms": first[1],
            "later_median_ms": later[0],
            "later_p90_ms": later[1],
            "first_over_later_median": first[0] / later[0],
            "first_over_later_p90": first[1] / later[1],
        }


def _stats(seconds: Sequence[float]) -> tuple[float, float]:
    """Median and p90, in milliseconds."""
    values = 1e3 * np.asarray(seconds)
    return float(np.median(values)), float(np.percentile(values, 90))


class PromptSource:
    """Distinct token-id prompts of corpus text: each starts with a token no earlier prompt started
    with, so no prompt shares a prefix-cache block with another."""

    def __init__(self, model: str | None, seed: int = 0) -> None:
        self.corpus = TokenCorpus(load_tokenizer(resolve_model_path(model)))
        self.rng = np.random.default_rng(seed)
        self.first_tokens: set[int] = set()

    def prompt(self, length: int) -> list[int]:
        while True:
            ids = self.corpus.window_ids(self.rng, length)
            if ids[0] not in self.first_tokens:
                self.first_tokens.add(ids[0])
                return ids


def ttft(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending one streamed completion to its first chunk with a choice; reads it to the end."""
    payload = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if first is None and _carries_tokens(line):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    return first


def _carries_tokens(line: str) -> bool:
    """Whether an SSE line is a chunk with a choice (a token), not usage, a comment or [DONE]."""
    if not line.startswith("data:") or line == "data: [DONE]":
        return False
    return bool(json.loads(line[len("data:") :]).get("choices"))


def run_round(
    client, url: str, prompts: PromptSource, lengths: Sequence[int], max_tokens: int
) -> list[float]:
    return [ttft(client, url, prompts.prompt(length), max_tokens) for length in lengths]


def keep_serving(
    client, url, prompts: PromptSource, lengths: Sequence[int], max_tokens: int, seconds: float
) -> int:
    """Requests of the same shapes, one at a time, for `seconds`; how many completed."""
    deadline, done = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        ttft(client, url, prompts.prompt(lengths[done % len(lengths)]), max_tokens)
        done += 1
    return done


def server_command(args: argparse.Namespace, config: str) -> list[str]:
    command = [llmserve_command(), "serve", "--port", str(args.port), *shlex.split(args.server_args)]
    if args.model:
        command += ["--model", args.model]
    return command if config == "none" else [*command, "--speculative-method", config]


def run_config(args: argparse.Namespace, config: str, prompts: PromptSource) -> ConfigResult:
    url, command = f"http://127.0.0.1:{args.port}", server_command(args, config)
    args.logs.mkdir(parents=True, exist_ok=True)
    with (args.logs / f"first-requests-{config}.log").open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    try:
        startup = wait_for_health(url, server, args.health_timeout)
        with httpx.Client(timeout=args.request_timeout) as client:
            first = run_round(client, url, prompts, args.lengths, args.max_tokens)
            served = keep_serving(client, url, prompts, args.lengths, args.max_tokens, args.serve_seconds)
            later = run_round(client, url, prompts, args.lengths, args.max_tokens)
    finally:
        _stop(server)
    result = ConfigResult(config, shlex.join(command), startup, first, later, served)
    result.summarize()
    return result


def speculation_ratios(results: Sequence[ConfigResult]) -> dict[str, dict[str, float]]:
    """Each speculative configuration's first-request TTFT median and p90 over `none`'s."""
    base = next((r for r in results if r.config == "none"), None)
    if base is None:
        return {}
    return {
        r.config: {
            "first_median_over_none": r.summary["first_median_ms"] / base.summary["first_median_ms"],
            "first_p90_over_none": r.summary["first_p90_ms"] / base.summary["first_p90_ms"],
        }
        for r in results
        if r.config != "none"
    }


def report(results: Sequence[ConfigResult]) -> str:
    columns = ["config", "startup_s", "first_median_ms", "first_p90_ms", "later_median_ms", "later_p90_ms"]
    columns += ["first_over_later_median", "first_over_later_p90"]
    rows = [{"config": r.config, "startup_s": r.startup_seconds, **r.summary} for r in results]
    lines = [format_table(rows, columns)]
    for config, ratios in speculation_ratios(results).items():
        lines.append(
            f"{config} first requests vs none: median x{ratios['first_median_over_none']:.2f}, "
            f"p90 x{ratios['first_p90_over_none']:.2f}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="none,ngram,draft_head", help="none and/or speculative methods")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths of one round, in order")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--serve-seconds", type=float, default=60.0, help="serving between the two rounds")
    parser.add_argument("--model", default=None, help="the server's --model (default: the embedded one)")
    parser.add_argument("--server-args", default="", help="more `llmserve serve` flags, one shell string")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--health-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench_results/first-requests.json"))
    parser.add_argument("--logs", type=Path, default=Path("bench_results/logs"))
    args = parser.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.configs = args.configs.split(",")
    return args


def main(argv: Sequence[str] | None = None) -> list[ConfigResult]:
    args = parse_args(argv)
    prompts = PromptSource(args.model, args.seed)
    results = []
    for config in args.configs:
        print(f"=== {config} {time.strftime('%H:%M:%S')}", flush=True)
        results.append(run_config(args, config, prompts))
    print(report(results))
    given = sys.argv[1:] if argv is None else list(argv)
    payload = {
        **run_metadata("first_requests"),
        "command": shlex.join(["python", "-m", "benchmarks.tools.first_requests", *given]),
        "lengths": args.lengths,
        "serve_seconds": args.serve_seconds,
        "configs": [asdict(r) for r in results],
        "speculation": speculation_ratios(results),
    }
    write_result(args.output, payload)
    return results


if __name__ == "__main__":
    main()
