"""Every `llmserve bench` figure draws as many points or bars per series as its result has rows."""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace as NS

import pytest

from llmserve.benchmarks.table_plot import TablePanel, plot_table


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions would save, kept for inspection instead."""
    drawn = []
    for module in ("latency", "memory", "throughput", "serve", "table_plot", "soak"):
        monkeypatch.setattr(
            importlib.import_module(f"llmserve.benchmarks.{module}"),
            "save_figure",
            lambda f, p: drawn.append(f),
        )
    yield drawn
    for figure in drawn:
        figure.clf()


def bars(axis) -> int:
    return len(axis.patches)


def points(axis) -> list[int]:
    """Points of each data line (horizontal reference lines have 2 and no marker)."""
    return [len(line.get_xdata()) for line in axis.get_lines() if line.get_marker() not in ("None", None, "")]


def test_throughput_one_bar_per_system(figures):
    from llmserve.benchmarks.throughput import plot_throughput

    result = lambda name, tok_s: NS(system=name, output_tok_s=tok_s, requests=8, output_tokens=512)  # noqa: E731
    plot_throughput(result("continuous", 90.0), [result("naive-4", 40.0), result("naive-8", 50.0)], "x.png")
    (axis,) = figures[0].axes
    assert bars(axis) == 3


def test_latency_one_point_per_prompt_length(figures):
    from llmserve.benchmarks.latency import plot_latency

    rows = [
        NS(prompt_len=n, prefill_tok_s=100.0 * n, decode_seconds_per_token=0.01) for n in (16, 64, 256, 1024)
    ]
    plot_latency(rows, NS(compute_ceiling_tok_s=1e5, floor_ms_per_token=2.0), "x.png")
    for axis in figures[0].axes:
        assert points(axis) == [4]


def test_memory_one_bar_per_strategy(figures):
    from llmserve.benchmarks.memory import plot_allocations

    rows = [NS(strategy=f"s{i}", concurrent_sequences=10 * i, waste=0.1) for i in range(5)]
    plot_allocations(rows, "64 MiB", "x.png")
    assert [bars(axis) for axis in figures[0].axes] == [5, 5]


def test_serve_sweep_one_point_per_rate_and_cdf_one_per_request(figures):
    from llmserve.benchmarks.serve import plot_distributions, plot_sweep

    percentiles = NS(p50=10.0, p99=20.0)
    sweep = [
        NS(
            output_throughput=100.0 * i,
            request_throughput=0.9 * rate,
            request_goodput=0.5 * rate,
            offered_rate=0.96 * rate,
            goodput_targets_ms={"ttft": 1000.0, "tpot": 50.0},
            latency_ms={m: percentiles for m in ("ttft", "tpot", "e2e")},
        )
        for i, rate in ((1, 1.0), (2, 2.0), (3, 4.0), (4, math.inf))
    ]
    plot_sweep([1.0, 2.0, 4.0, math.inf], sweep, "x.png")
    goodput, *latencies = figures[0].axes
    assert points(goodput) == [3, 3]  # completed and goodput at the finite rates (offered: a guide line)
    labels = [line.get_label() for line in goodput.get_lines()]
    assert labels == ["offered", "offered as drawn", "completed", "goodput"]
    assert list(goodput.get_lines()[1].get_ydata()) == [0.96, 1.92, 3.84]
    assert all(points(axis) == [4, 4] for axis in latencies)
    requests = [NS(ok=True, ttft=0.1 * i, tpot=0.01, e2e=1.0 + i) for i in range(7)]
    plot_distributions(requests, "y.png")
    assert [len(axis.get_lines()[0].get_xdata()) for axis in figures[1].axes] == [7, 7, 7]


def test_table_commands_one_bar_per_row(figures):
    from llmserve.benchmarks.spec_decode import plot_spec_decode

    latency = [
        {"workload": w, "method": m, "ms_per_token": 5.0, "speedup": 1.5}
        for w in ("code", "chat")
        for m in ("none", "ngram", "draft_head")
    ]
    throughput = [{"mode": "ngram", "batch_size": b, "output_tok_s": 80.0 * b} for b in (1, 8)]
    plot_spec_decode({"latency": latency, "throughput": throughput}, "x.png")
    assert [bars(axis) for axis in figures[0].axes] == [6, 6, 2]
    priority = [{"policy": p, "interactive_p99_ms": 40.0} for p in ("fcfs", "priority")]
    plot_table([TablePanel("p99", priority, ["policy"], "interactive_p99_ms")], "y.png")
    assert [bars(axis) for axis in figures[1].axes] == [2]


def test_soak_one_point_per_rss_sample(figures):
    from llmserve.benchmarks.soak import plot_rss

    plot_rss([(100 * i, 300.0 + i) for i in range(1, 12)], 300, "x.png")
    assert points(figures[0].axes[0]) == [11]


def test_every_bench_command_with_a_result_file_draws_with_plot():
    """`workload` writes a dataset, not a result; every other command takes --plot and draws with it."""
    import argparse
    import inspect

    from llmserve.benchmarks import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    bench = parser._subparsers._group_actions[0].choices["bench"]
    commands = bench._subparsers._group_actions[0].choices
    for module in cli.COMMANDS:
        if module.__name__.endswith(".workload"):
            continue
        (name,) = [n for n, p in commands.items() if p.get_default("handler").__module__ == module.__name__]
        assert "--plot" in commands[name]._option_string_actions, name
        assert "if args.plot" in inspect.getsource(module), name
