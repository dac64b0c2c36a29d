"""`llmserve bench soak`: thousands of mixed requests against a server it starts, then gates.

The server runs with `--check-invariants` (the KV integrity checks after every step) and whatever
`server_args` add (a small `--kv-cache-memory` forces preemption; `--speculative-method ngram`
speculates). The mix: greedy requests checked against their reference (the same request run alone
first, in float32, where batching does not change greedy tokens), streams, n = 2, stop strings,
logprobs, client disconnects at random points, bad requests (expected 4xx), and slow readers that
open a stream and read nothing for a while.

Gates (`SoakReport.failures`): no invariant violation, no leaked block (running, waiting and KV usage
back to zero), every completed greedy text equal to its reference, no 5xx and no unexpected error in
the server's log, and, over at least 3,000 requests after warm-up, an RSS slope (server, engine and
workers, sampled every 100 requests) under the bound in MB per 1,000 requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from llmserve.benchmarks.results import bench_dependency, pyplot, save_figure

GREEDY_PROMPTS = [f"Item {i}: the story of the number {i * 7} begins" for i in range(16)]
KINDS = ("greedy", "stream", "n2", "stop", "logprobs", "disconnect", "bad", "slow_reader")
WEIGHTS = (20, 15, 10, 10, 10, 30, 5, 2)  # disconnects: 30 of 102
RSS_EVERY = 100
RSS_MIN_REQUESTS = 3000


@dataclass
class SoakConfig:
    num_requests: int = 3000
    concurrency: int = 16
    max_tokens: int = 32
    seed: int = 0
    warmup_requests: int = 300  # left out of the RSS slope
    max_rss_slope_mb_per_1k: float = 5.0


@dataclass
class SoakReport:
    requests: dict[str, int] = field(default_factory=dict)  # by kind
    disconnects: int = 0
    bad_requests_4xx: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    server_errors: list[str] = field(default_factory=list)  # 5xx or unexpected bodies, first 20
    preemptions: float = 0.0
    draft_tokens: float = 0.0  # speculative decoding: drafts verified, and of them accepted
    accepted_tokens: float = 0.0
    invariant_violations: float = 0.0
    leaked: dict[str, float] = field(default_factory=dict)  # running, waiting, KV usage at the end
    rss_mb: list[tuple[int, float]] = field(default_factory=list)  # (requests done, MB)
    server_rss_mb: list[tuple[int, float]] = field(default_factory=list)  # the API server alone
    rss_slope_mb_per_1k: float | None = None
    server_rss_slope_mb_per_1k: float | None = None  # its share of the slope; the rest is the engine's
    allocator: str = ""  # what the server's processes malloc with: "tcmalloc", "system" or "mixed"
    log_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def failures(self, config: SoakConfig) -> list[str]:
        failed = []
        if self.invariant_violations:
            failed.append(f"{self.invariant_violations:g} invariant violations")
        if any(self.leaked.values()):
            failed.append(f"not back to idle: {self.leaked}")
        if self.greedy_mismatches:
            failed.append(f"{self.greedy_mismatches} greedy texts differ from their reference")
        if self.server_errors:
            failed.append(f"{len(self.server_errors)} server errors, first: {self.server_errors[0]}")
        if self.log_errors:
            failed.append(f"{len(self.log_errors)} unexpected log errors, first: {self.log_errors[0]}")
        slope = self.rss_slope_mb_per_1k
        if slope is not None and slope > config.max_rss_slope_mb_per_1k:
            failed.append(
                f"RSS grows {slope:.2f} MB per 1k requests (bound {config.max_rss_slope_mb_per_1k})"
            )
        return failed


def _in_band_error(line: str) -> bool:
    """An SSE event whose payload is an error object (not a completion whose text says "error")."""
    if not line.startswith("data: {"):
        return False
    try:
        return "error" in json.loads(line[len("data: ") :])
    except ValueError:
        return True  # a malformed event is a server fault too


def rss_slope(samples: list[tuple[int, float]], after: int) -> float | None:
    """Least-squares slope of RSS (MB) over requests, per 1,000 requests, of the samples past `after`;
    None with fewer than RSS_MIN_REQUESTS requests past it."""
    points = [(n, mb) for n, mb in samples if n > after]
    if len(points) < 3 or points[-1][0] - after < RSS_MIN_REQUESTS:
        return None
    mean_n = sum(n for n, _ in points) / len(points)
    mean_mb = sum(mb for _, mb in points) / len(points)
    cov = sum((n - mean_n) * (mb - mean_mb) for n, mb in points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    return 1000.0 * cov / var


def plot_rss(samples: list[tuple[int, float]], warmup_requests: int, path) -> None:
    """RSS of the server's process tree against requests done, one point per sample; the warm-up
    the slope leaves out is shaded."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([n for n, _ in samples], [mb for _, mb in samples], marker="o", markersize=3)
    axis.axvspan(0, warmup_requests, color="0.9", label="warm-up (not in the slope)")
    axis.set_xlabel("requests done")
    axis.set_ylabel("RSS of server, engine and workers (MB)")
    axis.set_title("soak: memory over requests")
    axis.legend()
    save_figure(figure, path)


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """RSS of a process and all its descendants (the server, its engine and any workers), and of the
    process alone, in MB: which side grows tells where to look."""
    psutil = bench_dependency("psutil")

    root = psutil.Process(pid)
    own = root.memory_info().rss
    total = own
    for process in root.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.memory_info().rss
    return total / 2**20, own / 2**20


def tree_allocator(pid: int) -> str:
    """Which malloc the tree runs on: "tcmalloc" where every process maps it, "system" where none does,
    else "mixed"."""
    psutil = bench_dependency("psutil")

    root = psutil.Process(pid)
    mapped = set()
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            mapped.add(any("libtcmalloc" in region.path for region in process.memory_maps()))
    return {frozenset({True}): "tcmalloc", frozenset({False}): "system"}.get(frozenset(mapped), "mixed")


class Soak:
    def __init__(self, base_url: str, model: str, config: SoakConfig, server_pid: int) -> None:
        self.base_url = base_url
        self.model = model
        self.config = config
        self.server_pid = server_pid
        self.report = SoakReport(requests=dict.fromkeys(KINDS, 0))
        self.references: dict[str, str] = {}
        self.rng = random.Random(config.seed)
        self.done = 0

    def body(self, prompt: str, **fields) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": self.config.max_tokens, **fields}

    async def run(self) -> SoakReport:
        start = time.monotonic()
        self.report.allocator = tree_allocator(self.server_pid)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=300) as http:
            for prompt in GREEDY_PROMPTS:  # references: each alone
                response = await http.post("/v1/completions", json=self.body(prompt, temperature=0))
                self.references[prompt] = response.json()["choices"][0]["text"]
            kinds = self.rng.choices(KINDS, WEIGHTS, k=self.config.num_requests)
            queue: asyncio.Queue = asyncio.Queue()
            for index, kind in enumerate(kinds):
                queue.put_nowait((index, kind))
            await asyncio.gather(*(self.worker(http, queue) for _ in range(self.config.concurrency)))
        self.report.seconds = time.monotonic() - start
        self.report.rss_slope_mb_per_1k = rss_slope(self.report.rss_mb, self.config.warmup_requests)
        self.report.server_rss_slope_mb_per_1k = rss_slope(
            self.report.server_rss_mb, self.config.warmup_requests
        )
        return self.report

    async def worker(self, http: httpx.AsyncClient, queue: asyncio.Queue) -> None:
        while not queue.empty():
            index, kind = queue.get_nowait()
            try:
                await getattr(self, f"_{kind}")(http, index)
            except httpx.HTTPError as error:
                self._server_error(f"{kind}: {type(error).__name__}: {error}")
            self.report.requests[kind] += 1
            self.done += 1
            if self.done % RSS_EVERY == 0:
                total, server = tree_rss_mb(self.server_pid)
                self.report.rss_mb.append((self.done, total))
                self.report.server_rss_mb.append((self.done, server))

    def _server_error(self, text: str) -> None:
        if len(self.report.server_errors) < 20:
            self.report.server_errors.append(text)
        else:
            self.report.server_errors.append("...")

    def _check(self, response: httpx.Response, kind: str) -> dict | None:
        if response.status_code >= 500 or (response.status_code >= 400 and kind != "bad"):
            self._server_error(f"{kind}: {response.status_code} {response.text[:200]}")
            return None
        return response.json()

    async def _greedy(self, http: httpx.AsyncClient, index: int) -> None:
        prompt = GREEDY_PROMPTS[index % len(GREEDY_PROMPTS)]
        body = self._check(
            await http.post("/v1/completions", json=self.body(prompt, temperature=0)), "greedy"
        )
        if body is not None:
            self.report.greedy_checked += 1
            self.report.greedy_mismatches += body["choices"][0]["text"] != self.references[prompt]

    async def _stream_events(self, http: httpx.AsyncClient, body: dict, kind: str, stop_after: int | None):
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                self._server_error(f"{kind}: {response.status_code}")
                return
            count = 0
            async for line in response.aiter_lines():
                if _in_band_error(line):
                    self._server_error(f"{kind}: {line[:200]}")
                count += 1
                if stop_after is not None and count >= stop_after:
                    self.report.disconnects += 1
                    return  # leaving the block closes the connection: the server aborts the request

    async def _stream(self, http: httpx.AsyncClient, index: int) -> None:
        await self._stream_events(
            http, self.body(f"Stream {index}", temperature=1.0, seed=index), "stream", None
        )

    async def _disconnect(self, http: httpx.AsyncClient, index: int) -> None:
        body = self.body(f"Disconnect {index}", temperature=1.0, ignore_eos=True)
        await self._stream_events(http, body, "disconnect", self.rng.randint(1, self.config.max_tokens))

    async def _n2(self, http: httpx.AsyncClient, index: int) -> None:
        self._check(await http.post("/v1/completions", json=self.body(f"Two {index}", n=2, seed=index)), "n2")

    async def _stop(self, http: httpx.AsyncClient, index: int) -> None:
        body = self.body(f"Stop {index}", stop=["e", " the"], temperature=1.0, seed=index)
        self._check(await http.post("/v1/completions", json=body), "stop")

    async def _logprobs(self, http: httpx.AsyncClient, index: int) -> None:
        body = self.body(f"Logprobs {index}", logprobs=3, temperature=1.0, seed=index)
        self._check(await http.post("/v1/completions", json=body), "logprobs")

    async def _bad(self, http: httpx.AsyncClient, index: int) -> None:
        bad = [
            b"{not json",
            json.dumps(self.body("x", max_tokens=-1)).encode(),
            json.dumps(self.body("x", n=10_000)).encode(),
            b'{"prompt": "x", "temperature": NaN}',
        ][index % 4]
        response = await http.post(
            "/v1/completions", content=bad, headers={"Content-Type": "application/json"}
        )
        if 400 <= response.status_code < 500 and "error" in response.json():
            self.report.bad_requests_4xx += 1
        else:
            self._server_error(f"bad: {response.status_code} {response.text[:200]}")

    async def _slow_reader(self, http: httpx.AsyncClient, index: int) -> None:
        body = self.body(f"Slow {index}", ignore_eos=True, max_tokens=self.config.max_tokens * 4)
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            await asyncio.sleep(2.0)  # the socket stays open, nothing is read
            self.report.disconnects += response.status_code == 200


def scrape(base_url: str) -> dict[str, float]:
    """The server's unlabelled series by name (every series carries the served model's `model_name`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if set(sample.labels) <= {"model_name"}
    }


def wait_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(base_url)
        gauges = {
            name: metrics.get(f"llmserve:{name}", 0.0)
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        }
        if not any(gauges.values()) or time.monotonic() > deadline:
            return {**metrics, **{f"leaked:{k}": v for k, v in gauges.items()}}
        time.sleep(0.2)


def server_command(model: str, port: int, server_args: list[str]) -> list[str]:
    """`llmserve serve` as users run it: through the console script's set-up (cli/launch.py: tcmalloc
    where installed, else glibc under worker/malloc_tuning.py's policy), whose allocator the RSS slope
    measures."""
    command = [sys.executable, "-m", "llmserve.cli.launch", "serve", "--model", model, "--port", str(port)]
    return [*command, "--check-invariants", *server_args]


def start_server(model: str, port: int, server_args: list[str], log_path: Path) -> subprocess.Popen:
    command = server_command(model, port, server_args)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"the server did not become healthy; see {log_path}")


def log_errors(log_path: Path) -> list[str]:
    """ERROR lines and tracebacks in the server's log: a soak expects none."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if " ERROR " in line or line.startswith("Traceback")][:20]


def run_soak(model: str, server_args: list[str], config: SoakConfig, log_path: Path, port: int) -> SoakReport:
    """Start the server, soak it, gate; the server is stopped however it ends."""
    server = start_server(model, port, server_args, log_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        name = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        soak = Soak(base_url, name, config, server.pid)
        report = asyncio.run(soak.run())
        metrics = wait_idle(base_url)
        report.leaked = {k.removeprefix("leaked:"): v for k, v in metrics.items() if k.startswith("leaked:")}
        report.preemptions = metrics.get("llmserve:num_preemptions_total", 0.0)
        report.draft_tokens = metrics.get("llmserve:spec_decode_num_draft_tokens_total", 0.0)
        report.accepted_tokens = metrics.get("llmserve:spec_decode_num_accepted_tokens_total", 0.0)
        report.invariant_violations = metrics.get("llmserve:invariant_violations_total", 0.0)
    finally:
        server.terminate()
        server.wait(60)
    report.log_errors = log_errors(log_path)
    return report


def report_dict(report: SoakReport) -> dict:
    return asdict(report)
