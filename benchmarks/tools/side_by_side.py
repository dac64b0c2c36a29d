"""Side by side through HTTP with a peer server (vLLM-CPU, llama.cpp), one system at a time.

    python -m benchmarks.tools.side_by_side TAG [--workload bench_results/mixed-100.jsonl] \
        [--peer-command "vllm serve ..." --peer-url http://127.0.0.1:8092 --peer-model smollm2] \
        [--engine-args "--model FILE --quantization gguf"] [--dry-run]

In order: the offline engine on the workload (`llmserve bench throughput --naive-batch-sizes none`);
a fresh `llmserve serve` swept at rates 2, 4, inf (`--rates`); a fresh server at rate inf (left out
when `--rates inf`); the peer, started by --peer-command (a shell command line) and swept at the same
rates; a fresh server at rate inf again; the
offline engine again. So each system is timed alone, ours before and after the peer (drift shows),
and HTTP against offline. Results: `RESULTS/serve-TAG-STEP.json` and `RESULTS/offline-TAG-N.json`,
each with its machine, command, date and commit, and `RESULTS/startup-TAG.json`: each server's
seconds from launch to its /health answering 200 (polled every 0.2 s); logs under --logs. Without
--peer-command the peer step is left out. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from llmserve.benchmarks.results import run_metadata, write_result

RATES_SWEEP = "2,4,inf"


@dataclasses.dataclass(frozen=True)
class Step:
    """One timed step: `bench` against `server` (None: offline, nothing to start)."""

    name: str
    bench: list[str]
    server: list[str] | None = None
    url: str | None = None


def llmserve_command() -> str:
    """The `llmserve` console script beside this Python (it preloads tcmalloc and sets serve's
    OpenMP spin, as a user's launch does), else the one on PATH."""
    beside = Path(sys.executable).parent / "llmserve"
    return str(beside) if beside.exists() else shutil.which("llmserve") or "llmserve"


def plan(args: argparse.Namespace) -> list[Step]:
    """The steps in the order they run."""
    llmserve = [llmserve_command()]
    ours_url = f"http://127.0.0.1:{args.port}"
    engine = shlex.split(args.engine_args)  # ours, offline and served alike
    ours_server = [*llmserve, "serve", "--port", str(args.port), *engine]

    def offline(index: int) -> Step:
        output = args.results / f"offline-{args.tag}-{index}.json"
        bench = ["bench", "throughput", "--workload", str(args.workload), "--naive-batch-sizes", "none"]
        return Step(f"offline-{index}", [*llmserve, *bench, *engine, "--output", str(output)])

    def serve(name: str, server: list[str] | None, url: str, rates: str, model: str | None = None) -> Step:
        bench = [
            *llmserve,
            "bench",
            "serve",
            "--url",
            url,
            "--workload",
            str(args.workload),
            "--sweep",
            rates,
        ]
        bench += ["--model", model] if model else []
        output = args.results / f"serve-{args.tag}-{name}.json"
        return Step(name, [*bench, "--output", str(output)], server, url)

    steps = [offline(1), serve("sweep", ours_server, ours_url, args.rates)]
    if args.rates != "inf":  # a sweep of rate inf alone is already the fresh server's rate-inf run
        steps.append(serve("inf1", ours_server, ours_url, "inf"))
    if args.peer_command:
        peer = ["bash", "-c", f"exec {args.peer_command}"]
        steps.append(serve("peer", peer, args.peer_url, args.rates, args.peer_model))
    return [*steps, serve("inf2", ours_server, ours_url, "inf"), offline(2)]


def wait_for_health(url: str, process: subprocess.Popen | None, timeout: float) -> float:
    """Seconds until `url`/health answers 200; raises if the server exits or the timeout passes."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url}/health answered")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health did not answer within {timeout:.0f} s")


def run_step(step: Step, logs: Path, tag: str, health_timeout: float) -> float | None:
    """Run the step; returns its server's seconds from launch to ready (None: no server)."""
    print(f"=== {step.name} {time.strftime('%H:%M:%S')}: {shlex.join(step.bench)}", flush=True)
    server = ready = None
    if step.server is not None:
        with (logs / f"{tag}_server_{step.name}.log").open("w") as log:
            # its own session, so stopping it stops whatever it started (a peer's workers too)
            server = subprocess.Popen(step.server, stdout=log, stderr=log, start_new_session=True)
        try:
            ready = wait_for_health(step.url, server, health_timeout)
            print(f"    ready after {ready:.1f} s", flush=True)
        except Exception:
            _stop(server)
            raise
    try:
        with (logs / f"{tag}_bench_{step.name}.log").open("w") as log:
            subprocess.run(step.bench, stdout=log, stderr=subprocess.STDOUT, check=True)
    finally:
        if server is not None:
            _stop(server)
    return ready


def _stop(server: subprocess.Popen) -> None:
    """Stop the server this tool started: its process group, by the id Popen gave it."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:
        pass


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tag", help="names this run's result files")
    parser.add_argument("--workload", type=Path, default=Path("bench_results/mixed-100.jsonl"))
    parser.add_argument("--results", type=Path, default=Path("bench_results"))
    parser.add_argument("--logs", type=Path, default=Path("bench_results/logs"))
    parser.add_argument("--port", type=int, default=8000, help="port of llmserve's server")
    parser.add_argument("--peer-command", default=None, help="shell command line that starts the peer")
    parser.add_argument("--peer-url", default="http://127.0.0.1:8092")
    parser.add_argument("--peer-model", default=None, help="model name to request from the peer")
    parser.add_argument("--health-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--rates", default=RATES_SWEEP, help="the sweep's request rates (inf: all at once)")
    parser.add_argument("--engine-args", default="", help="flags for our serve and offline runs (one string)")
    parser.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    steps = plan(args)
    if args.dry_run:
        for step in steps:
            server = f"  [server: {shlex.join(step.server)}]" if step.server else ""
            print(f"{step.name}: {shlex.join(step.bench)}{server}")
        return
    if not args.workload.is_file():
        raise SystemExit(f"no workload {args.workload}: llmserve bench workload --out {args.workload} ...")
    args.results.mkdir(parents=True, exist_ok=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    startup = []
    for step in steps:
        ready = run_step(step, args.logs, args.tag, args.health_timeout)
        if ready is not None:
            startup.append({"step": step.name, "server": shlex.join(step.server), "ready_seconds": ready})
            given = sys.argv[1:] if argv is None else list(argv)
            command = shlex.join(["python", "-m", "benchmarks.tools.side_by_side", *given])
            payload = {**run_metadata("startup"), "command": command, "servers": startup}
            write_result(args.results / f"startup-{args.tag}.json", payload)


if __name__ == "__main__":
    main()
