"""What every benchmark shares: run metadata, JSON result files, plain-text tables, figures.

A number without the machine, command, date and commit that produced it cannot be compared later,
so every result file carries them next to the measurements.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

RESULTS_DIR = "bench_results"
BENCH_EXTRA = "llmserve[bench]"  # plotting and load generation: not needed to serve, so not installed with it


def bench_dependency(name: str) -> ModuleType:
    """Import a module that only the benchmarks use (the `bench` extra), or stop with one line naming
    the extra; the package itself never imports these at module level."""
    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"{name} is not installed: pip install '{BENCH_EXTRA}' (the benchmark extra)"
        raise SystemExit(message) from None


def git_commit(start: str | os.PathLike | None = None) -> str | None:
    """The commit checked out at `start` (default: where this llmserve is imported from, so a run
    started from another directory still names the code it ran), read from .git without running git;
    None outside a checkout."""
    start = Path(__file__).parent if start is None else Path(start)
    for folder in [start.resolve(), *start.resolve().parents]:
        git_dir = folder / ".git"
        if git_dir.is_dir():
            return _resolve_head(git_dir, git_dir)
        if git_dir.is_file():  # a linked worktree: ".git" names its own git dir, refs are shared
            linked = Path(git_dir.read_text().split("gitdir:", 1)[1].strip())
            linked = linked if linked.is_absolute() else folder / linked
            common = linked / "commondir"
            shared = (linked / common.read_text().strip()).resolve() if common.is_file() else linked
            return _resolve_head(linked, shared)
    return None


def _resolve_head(git_dir: Path, refs_dir: Path) -> str | None:
    head = (git_dir / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head  # detached HEAD holds the commit itself
    ref = head[len("ref: ") :]
    loose = refs_dir / ref
    if loose.is_file():
        return loose.read_text().strip()
    packed = refs_dir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    return None  # a branch without commits yet


def machine_description(device: torch.device | str | None = None) -> dict[str, Any]:
    """Hardware and software that the numbers depend on."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if device is not None and torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def run_metadata(benchmark: str, device: torch.device | str | None = None) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "command": " ".join(["llmserve", *sys.argv[1:]]) if sys.argv else "",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": machine_description(device),
    }


def default_output_path(benchmark: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(RESULTS_DIR) / f"{benchmark}-{stamp}.json"


def write_result(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to a result file")


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as an aligned text table: floats to 2 decimals (3 significant digits below 1)."""
    cells = [[_format_cell(row.get(column)) for column in columns] for row in rows]
    # a list, so that a table without rows (every request failed) still has its header widths
    widths = [max([len(column), *(len(r[i]) for r in cells)]) for i, column in enumerate(columns)]
    lines = [_align(columns, widths), "  ".join("-" * w for w in widths)]
    lines += [_align(r, widths) for r in cells]
    return "\n".join(lines)


def _align(cells: Sequence[str], widths: Sequence[int]) -> str:
    """The first column (a name) left-aligned, the numbers after it right-aligned."""
    first, *rest = cells
    return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))])


def _format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) >= 1 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def pyplot():
    """matplotlib.pyplot on a file-only backend, imported only when a figure is asked for."""
    bench_dependency("matplotlib").use("Agg")
    return bench_dependency("matplotlib.pyplot")


def save_figure(figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot().close(figure)
    return path
