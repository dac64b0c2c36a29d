"""Time from an engine kill to serving again, under load, against a running `llmserve serve`.

    llmserve serve &
    python -m benchmarks.tools.engine_kill --url http://127.0.0.1:8000 --concurrency 16 \
        --max-tokens 128 --kills 3 --out engine_kill.json

`--concurrency` clients send streamed completions back to back (a refused or failed one is sent again
after 0.1 s). After `--load-seconds` of load the engine process (the server's child; found from the
process listening on the URL's port, or `--server-pid`) gets SIGKILL, and the tool times, from the
kill: /health turning 503, /health 200 again, and the first request sent after the kill that completes.
It counts the streams the kill ended and the outcomes of the requests sent while the engine restarted
(503, a stream's in-band error, or served once the new engine took them), and checks
that the killed process and its workers are gone. Each of `--kills` rounds waits for /health 200 first.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import statistics
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil

from llmserve.benchmarks.results import run_metadata, write_result


def server_pid(url: str) -> int:
    """The pid of the process listening on the URL's port."""
    port = urlparse(url).port or 80
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return connection.pid
    raise ValueError(f"no process listens on port {port}; pass --server-pid")


def engine_process(pid: int) -> psutil.Process:
    """The server's engine process: its child that is not multiprocessing's resource tracker."""
    children = [
        child
        for child in psutil.Process(pid).children()
        if "resource_tracker" not in " ".join(child.cmdline())
    ]
    if len(children) != 1:
        raise ValueError(f"expected one engine process under pid {pid}, found {[c.pid for c in children]}")
    return children[0]


class Load:
    """Clients sending streamed completions back to back; what each request ended with, and when."""

    def __init__(self, http: httpx.AsyncClient, body: dict) -> None:
        self.http, self.body = http, body
        self.records: list[tuple[float, float, str]] = []  # (sent, ended, outcome)
        self.stop = asyncio.Event()

    async def client(self, delay: float = 0.0) -> None:
        # clients start `delay` apart, so that their identical requests do not all end in one step
        await asyncio.sleep(delay)
        while not self.stop.is_set():
            sent = time.monotonic()
            outcome = await self._one()
            self.records.append((sent, time.monotonic(), outcome))
            if outcome != "ok":
                await asyncio.sleep(0.1)

    async def _one(self) -> str:
        """ok, http_<status>, error (an in-band error or an abort), or transport."""
        try:
            async with self.http.stream("POST", "/v1/completions", json=self.body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return f"http_{response.status_code}"
                outcome = "ok"
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and (
                        '"error"' in line or '"finish_reason":"abort"' in line
                    ):
                        outcome = "error"
                return outcome
        except httpx.TransportError:
            return "transport"


async def health(http: httpx.AsyncClient) -> int | None:
    try:
        return (await http.get("/health", timeout=2)).status_code
    except httpx.TransportError:
        return None


async def wait_health(http: httpx.AsyncClient, want, timeout: float) -> float:
    """Poll /health every 50 ms until `want(status)`; the time it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if want(await health(http)):
            return time.monotonic()
        await asyncio.sleep(0.05)
    raise TimeoutError("/health did not change in time")


async def one_kill(http: httpx.AsyncClient, load: Load, pid: int, args: argparse.Namespace) -> dict:
    await wait_health(http, lambda status: status == 200, args.restart_timeout)
    await asyncio.sleep(args.load_seconds)
    engine = engine_process(pid)
    group = [engine, *engine.children(recursive=True)]
    killed = time.monotonic()
    engine.send_signal(signal.SIGKILL)
    unhealthy = await wait_health(http, lambda status: status != 200, 30)
    ready = await wait_health(http, lambda status: status == 200, args.restart_timeout)
    deadline = time.monotonic() + args.restart_timeout
    while not any(sent > killed and outcome == "ok" for sent, _, outcome in load.records):
        if time.monotonic() > deadline:
            raise TimeoutError("no request sent after the kill has completed")
        await asyncio.sleep(0.05)
    ended = [r for r in load.records if r[0] < killed < r[1]]  # in flight at the kill
    after = [r for r in load.records if killed <= r[0] <= ready]
    return {
        "kill_to_health_503_s": unhealthy - killed,
        "kill_to_health_200_s": ready - killed,
        "kill_to_first_completion_s": min(end for sent, end, o in load.records if sent > killed and o == "ok")
        - killed,
        "in_flight_at_kill": len(ended),
        "in_flight_ended_with_error": sum(outcome != "ok" for _, _, outcome in ended),
        # sent between the kill and /health 200: refused (a 503, or a stream's in-band error) or served
        "sent_while_restarting": dict(collections.Counter(outcome for _, _, outcome in after)),
        "killed_pid": engine.pid,
        "orphans": [p.pid for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
    }


async def run(args: argparse.Namespace) -> dict:
    pid = args.server_pid or server_pid(args.url)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens, "ignore_eos": True}
        load = Load(http, {**body, "stream": True})
        clients = [asyncio.create_task(load.client(0.05 * i)) for i in range(args.concurrency)]
        try:
            rounds = [await one_kill(http, load, pid, args) for _ in range(args.kills)]
        finally:
            load.stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
    summary = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("kill_to_health_503_s", "kill_to_health_200_s", "kill_to_first_completion_s")
    }
    return {"summary_median": summary, "rounds": rounds, "requests": len(load.records)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, default=None, help="default: the process on --url's port")
    parser.add_argument("--concurrency", type=int, default=16, help="clients sending requests back to back")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt", default="Write a long story about a lighthouse keeper.")
    parser.add_argument("--load-seconds", type=float, default=5.0, help="load before each kill")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--restart-timeout", type=float, default=300.0)
    parser.add_argument("--out", default="engine_kill.json")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    write_result(Path(args.out), {**run_metadata("engine_kill"), "args": vars(args), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
