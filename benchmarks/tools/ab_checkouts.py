"""A/B of two checkouts: offline throughput and batch-1 decode, each run a fresh process, alternated.

    python -m benchmarks.tools.ab_checkouts BASE NEW --workload bench_results/mixed-100.jsonl \
        [--rounds 3] [--out benchmarks/results/DATE-NAME.jsonl]

BASE and NEW are git revisions (each gets a detached worktree under --worktrees, kept for the next
call) or paths of checkouts to use as they are. Each run is a fresh process of this file with
PYTHONPATH set to one checkout, so it imports that checkout's llmserve; the compiled kernels build
once per checkout (a few minutes on two cores, the first time only). Rounds alternate the order
(base, new / new, base / ...), so drift of the machine's speed within the A/B hits both sides.

One run (`measure`): the default engine, the whole workload at once, total tokens/s of the best of
`passes` passes; then batch-1 decode ms/token (the first workload prompt's first 16 tokens, 128 greedy
tokens, median of 3). Every run prints one JSON line; the last lines give each side's medians.
Make the workload with `llmserve bench workload --out FILE --num-requests 100 --seed 0`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

TAGS = ("base", "new")


def measure(
    llm,
    requests: Sequence,
    passes: int = 3,
    decode_prompt_tokens: int = 16,
    decode_tokens: int = 128,
    decode_repeats: int = 3,
) -> dict:
    """Best-of-`passes` total tok/s over `requests` (all at once), then batch-1 decode ms/token. The
    prefix cache is emptied before each pass: a pass over prompts the last one cached would measure
    the cache, not the engine (the second pass of mixed-100 ran 1.5x faster than the first)."""
    from llmserve import SamplingParams

    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    total_tokens = sum(map(len, prompts)) + sum(r.max_tokens for r in requests)
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    rates, cached = [], 0
    for _ in range(passes):
        llm.engine.kv_cache_manager.pool.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(total_tokens / (time.perf_counter() - start))
        cached += sum(output.num_cached_tokens for output in outputs)
    one = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    decode_ms = [_decode_ms(llm, prompts[0][:decode_prompt_tokens], one) for _ in range(decode_repeats)]
    return {
        "tok_s": max(rates),
        "passes": [round(rate, 1) for rate in rates],
        "cached_prompt_tokens": cached,
        "b1_ms": statistics.median(decode_ms),
        "b1_all": [round(ms, 2) for ms in decode_ms],
    }


def _decode_ms(llm, prompt: list[int], params) -> float:
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    metrics = output.metrics
    return 1e3 * (metrics.finished_time - metrics.first_token_time) / (len(output.outputs[0].token_ids) - 1)


def round_orders(rounds: int) -> list[tuple[str, str]]:
    """base, new in odd rounds and new, base in even ones."""
    return [TAGS if index % 2 == 0 else TAGS[::-1] for index in range(rounds)]


def summarize(runs: Sequence[dict]) -> dict:
    """Each side's median tok/s and batch-1 ms/token, and new relative to base."""
    summary = {}
    for tag in TAGS:
        mine = [run for run in runs if run["tag"] == tag]
        summary[tag] = {
            "runs": len(mine),
            "tok_s": statistics.median(run["tok_s"] for run in mine),
            "b1_ms": statistics.median(run["b1_ms"] for run in mine),
        }
    summary["new_vs_base"] = {
        "tok_s": summary["new"]["tok_s"] / summary["base"]["tok_s"] - 1,
        "b1_ms": summary["new"]["b1_ms"] / summary["base"]["b1_ms"] - 1,
    }
    return summary


def resolve_commit(repo: Path, revision: str) -> str:
    command = ["git", "-C", str(repo), "rev-parse", "--verify", f"{revision}^{{commit}}"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def ensure_checkout(repo: Path, revision: str, worktrees: Path) -> tuple[Path, str]:
    """A checkout of `revision` and its commit: the path itself if it is a directory (its commit marked
    -dirty if tracked files changed), else a detached worktree under `worktrees`, added once and reused."""
    if Path(revision).is_dir():
        path = Path(revision).resolve()
        status = ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, check=True, capture_output=True, text=True).stdout.strip()
        return path, resolve_commit(path, "HEAD") + ("-dirty" if dirty else "")
    commit = resolve_commit(repo, revision)
    path = worktrees / commit[:12]
    if not path.exists():
        worktrees.mkdir(parents=True, exist_ok=True)
        add = ["git", "-C", str(repo), "worktree", "add", "--detach", str(path), commit]
        subprocess.run(add, check=True, capture_output=True)
    elif resolve_commit(path, "HEAD") != commit:
        raise SystemExit(f"{path} exists but is not at {commit}; remove it or pass --worktrees")
    return path, commit


def child_command(checkout: Path, tag: str, workload: Path, passes: int) -> tuple[list[str], dict]:
    """This file run as a script (so an older checkout needs no copy of it) with the checkout first
    on PYTHONPATH, and the environment to run it in."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    argv = [sys.executable, str(Path(__file__).resolve()), "--measure", str(workload)]
    return [*argv, "--tag", tag, "--checkout", str(checkout), "--passes", str(passes)], env


def run_child(checkout: Path, tag: str, workload: Path, passes: int) -> dict:
    argv, env = child_command(checkout, tag, workload, passes)
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tag} run failed ({checkout}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_main(args: argparse.Namespace) -> None:
    """In the child: load the checkout's llmserve, measure, print one JSON line."""
    import llmserve
    from llmserve import LLM
    from llmserve.benchmarks.workload import load_jsonl

    source = Path(llmserve.__file__).resolve()
    if Path(args.checkout).resolve() not in source.parents:
        raise SystemExit(f"imported {source}, not the checkout {args.checkout}")
    llm = LLM()
    requests = load_jsonl(args.measure, llm.tokenizer)
    result = measure(llm, requests, passes=args.passes)
    print(json.dumps({"tag": args.tag, "src": str(source), **result}))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", help="git revision or checkout directory")
    parser.add_argument("new", nargs="?", help="git revision or checkout directory")
    parser.add_argument("--workload", type=Path, default=Path("bench_results/mixed-100.jsonl"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=3, help="throughput passes per run (best is kept)")
    parser.add_argument("--repo", type=Path, default=Path("."), help="the repository the revisions name")
    parser.add_argument("--worktrees", type=Path, default=Path(tempfile.gettempdir()) / "llmserve-ab")
    parser.add_argument("--out", type=Path, default=None, help="also append every JSON line here")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: the workload file
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--checkout", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        return _measure_main(args)
    if not (args.base and args.new):
        parser.error("BASE and NEW are required")
    if not args.workload.is_file():
        parser.error(f"no workload {args.workload}: llmserve bench workload --out {args.workload} ...")
    checkouts = {
        tag: ensure_checkout(args.repo, revision, args.worktrees)
        for tag, revision in zip(TAGS, (args.base, args.new), strict=True)
    }
    runs = []
    for order in round_orders(args.rounds):
        for tag in order:
            checkout, commit = checkouts[tag]
            run = {**run_child(checkout, tag, args.workload.resolve(), args.passes), "commit": commit}
            runs.append(run)
            _emit(run, args.out)
    _emit({"summary": summarize(runs)}, args.out)


def _emit(line: dict, out: Path | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        with out.open("a") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
