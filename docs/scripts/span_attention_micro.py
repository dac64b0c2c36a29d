"""paged_attention alone, this checkout's build against a baseline commit's, interleaved in one process.

SmolLM2 shapes (9 query heads, 3 KV heads, head_dim 64, block 16, bf16 cache). Cases: batch 1 with
spans of 1, 2, 4 and 8 query tokens (speculative verification of k drafts + 1) at contexts 500 and 1000,
and batch 32 / 64 decodes (one query each) at contexts 300-1000. Calls cycle through cache layouts
(blocks scattered in one pool): enough of them that K and V come from memory, as in a real step whose
other layers and weights pass through the caches in between, and then few enough that they stay in
L3. The machine's speed drifts, so each round times a few calls of one build then the other
(alternating which goes first), each call on the next layout; medians over rounds, us per call.

The baseline's kernel sources come from `git show REF:llmserve/kernels/csrc/...` and its
paged_attention.cpp builds (once, ~30 s) into /tmp as a module of its own that binds only that op
(a second copy of the whole module would register the DecodeStack class twice).

Usage: PYTHONPATH=<checkout> python docs/scripts/span_attention_micro.py [BASELINE_REF] [ROUNDS]
"""

import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmserve.kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CSRC = "llmserve/kernels/csrc"
BINDING = """#include <torch/extension.h>
#include "kernels.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_attention", &paged_attention); }
"""


def load_baseline(ref: str):
    repo = Path(cpu_ops.__file__).resolve().parents[2]
    git = functools.partial(subprocess.check_output, cwd=repo, text=True)
    commit = git(["git", "rev-parse", ref]).strip()
    root = Path(tempfile.gettempdir()) / f"llmserve_csrc_{commit[:12]}"
    csrc = root / "csrc"
    if not csrc.exists():
        staging = root / "staging"
        staging.mkdir(parents=True, exist_ok=True)
        for name in git(["git", "ls-tree", "--name-only", f"{commit}:{CSRC}"]).split():
            (staging / name).write_text(git(["git", "show", f"{commit}:{CSRC}/{name}"]))
        (staging / "baseline_module.cpp").write_text(BINDING)
        staging.rename(csrc)
    build = root / "build"
    build.mkdir(exist_ok=True)
    from torch.utils.cpp_extension import load

    return load(
        name=f"llmserve_cpu_ops_{commit[:12]}",
        sources=[str(csrc / "paged_attention.cpp"), str(csrc / "baseline_module.cpp")],
        extra_cflags=cpu_ops._CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def make_case(batch: int, num_queries: int, context: int, footprint: int, seed: int = 0):
    """Arguments for calls of `batch` sequences, each call its own blocks of one pool, as many layouts as
    make `footprint` bytes of K and V (at least 2)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    layouts = max(2, -(-footprint // (2 * batch * blocks * BLOCK * KV_HEADS * HEAD_DIM * 2)))
    pool = layouts * batch * blocks + 64
    key_cache, value_cache = (
        torch.randn(pool * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2)
    )
    tables = torch.randperm(pool, generator=gen)[: layouts * batch * blocks].view(layouts, batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int64)
    query = torch.randn(batch * num_queries, HEADS, HEAD_DIM, generator=gen).bfloat16()
    starts = torch.arange(batch + 1) * num_queries
    return [
        (query, key_cache, value_cache, tables[i].contiguous(), lens, starts, BLOCK, HEAD_DIM**-0.5, 0, 0, 0)
        for i in range(layouts)
    ]


def interleaved_us(builds: dict, calls: list, rounds: int, per_round: int) -> dict[str, float]:
    """Median us per call of each build; every call reads the next layout in turn, so no build finds
    blocks that the other one just brought into the caches."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    cursor = 0
    for round_index in range(rounds):
        names = list(builds) if round_index % 2 == 0 else list(reversed(builds))
        for name in names:
            function = builds[name].paged_attention
            start = time.perf_counter()
            for k in range(per_round):
                function(*calls[(cursor + k) % len(calls)])
            times[name].append((time.perf_counter() - start) / per_round * 1e6)
            cursor += per_round
    return {name: statistics.median(values) for name, values in times.items()}


REGIMES = (  # (title, bytes of K and V the calls cycle through)
    ("K/V from memory (64 MiB of layouts, twice L3: as in a real step)", 64 << 20),
    ("K/V in L3 (8 MiB of layouts)", 8 << 20),
)


def main() -> None:
    ref = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    builds = {"old": load_baseline(ref), "new": cpu_ops.load_cpu_ops()}
    cases = [(1, q, ctx) for ctx in (500, 1000) for q in (1, 2, 4, 8)]
    cases += [(batch, 1, ctx) for batch in (32, 64) for ctx in (300, 1000)]
    print(f"baseline {ref}, {torch.get_num_threads()} threads, {rounds} rounds; us per call (median)")
    for title, footprint in REGIMES:
        print(f"\n{title}\n{'batch':>5} {'q':>2} {'context':>7} {'old':>9} {'new':>9} {'old/new':>7}")
        for batch, num_queries, context in cases:
            calls = make_case(batch, num_queries, context, footprint)
            expected = builds["old"].paged_attention(*calls[0])
            actual = builds["new"].paged_attention(*calls[0])
            torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
            for function in builds.values():  # warm-up
                for args in calls[:20]:
                    function.paged_attention(*args)
            per_round = 10 if batch == 1 else 2
            result = interleaved_us(builds, calls, rounds if batch == 1 else rounds // 8, per_round)
            old, new = result["old"], result["new"]
            print(
                f"{batch:5d} {num_queries:2d} {context:7d} {old:9.1f} {new:9.1f} {old / new:7.2f}", flush=True
            )


if __name__ == "__main__":
    main()
