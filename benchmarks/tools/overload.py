"""Overload against a running server: its 429s, their Retry-After against the real wait.

    python -m benchmarks.tools.overload --url http://127.0.0.1:8000 --num-requests 400 \
        --timeout 5 --out overload.json

Fires `--num-requests` streamed completions at once, each with `timeout`. An admitted request's time
to its first chunk is its real queue wait plus its prefill; a refused one (429) is sent again once
its `Retry-After` has passed. The result: how many were admitted, refused and timed out (408), the
Retry-After values, the first-chunk times of the admitted ones against the timeout (a prediction that
admitted a request which then waited past its timeout is a miss), and the share of refused requests
admitted on their retry (a Retry-After too short is refused again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from llmserve.benchmarks.results import run_metadata, write_result


async def one(http: httpx.AsyncClient, body: dict) -> tuple[int, float | None, int | None]:
    """(status, seconds to the first chunk or None, Retry-After or None)."""
    start = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            retry = response.headers.get("Retry-After")
            return response.status_code, None, int(retry) if retry else None
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.monotonic() - start
            if '"code":"408"' in line:
                return 408, first, None
        return 200, first, None


async def request_with_retry(http: httpx.AsyncClient, body: dict) -> dict:
    status, first, retry_after = await one(http, body)
    record = {"status": status, "first_chunk_s": first, "retry_after_s": retry_after}
    if status == 429 and retry_after is not None:
        await asyncio.sleep(retry_after)
        record["retry_status"], record["retry_first_chunk_s"], _ = await one(http, body)
    return record


def quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "max": values[-1], "mean": statistics.fmean(values)}


async def run(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.num_requests)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": args.prompt,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "timeout": args.timeout,
        }
        records = await asyncio.gather(*(request_with_retry(http, body) for _ in range(args.num_requests)))
    refused = [r for r in records if r["status"] == 429]
    admitted = [r for r in records if r["status"] in (200, 408)]
    return {
        "requests": len(records),
        "admitted": len(admitted),
        "refused_429": len(refused),
        "timed_out_408": sum(r["status"] == 408 for r in records),
        "other": sum(r["status"] not in (200, 408, 429) for r in records),
        "first_chunk_s_of_admitted": quantiles([r["first_chunk_s"] for r in admitted if r["first_chunk_s"]]),
        "admitted_waiting_past_timeout": sum(
            1 for r in admitted if r["first_chunk_s"] is not None and r["first_chunk_s"] > args.timeout
        ),
        "retry_after_s": quantiles([r["retry_after_s"] for r in refused if r["retry_after_s"] is not None]),
        "admitted_on_retry": sum(r.get("retry_status") == 200 for r in refused),
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=5.0, help="each request's `timeout` field, seconds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="Write a long story about a lighthouse keeper.")
    parser.add_argument("--out", default="overload.json")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "records"}
    print(json.dumps(summary, indent=2))
    write_result(Path(args.out), {**run_metadata("overload"), "args": vars(args), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
