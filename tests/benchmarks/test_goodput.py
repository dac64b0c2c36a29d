"""Goodput (vLLM's request_goodput) on hand-made request records, and the `--goodput` flag's parsing."""

from __future__ import annotations

import math

import pytest

from llmserve.benchmarks.commands.serve import rate_list
from llmserve.benchmarks.goodput import goodput_targets
from llmserve.benchmarks.serve import RequestResult, summarize
from llmserve.cli.main import main

OK = dict(ok=True, prompt_tokens=10)


def records() -> list[RequestResult]:
    return [
        RequestResult(**OK, output_tokens=11, ttft=0.2, e2e=0.7),  # TTFT 200, TPOT 50, e2e 700: meets all
        RequestResult(**OK, output_tokens=11, ttft=1.5, e2e=2.0),  # TTFT 1500: misses ttft
        RequestResult(**OK, output_tokens=11, ttft=0.1, e2e=1.1),  # TPOT 100: misses tpot
        RequestResult(**OK, output_tokens=1, ttft=0.3, e2e=0.3),  # one token: no TPOT, meets
        RequestResult(**OK, output_tokens=101, ttft=0.1, e2e=4.1),  # TPOT 40 but e2e 4.1 s
        RequestResult(error="HTTP 429: the server's waiting queue is full"),  # refused: a miss
        RequestResult(error="ClientConnectionError: reset"),  # failed: a miss
        RequestResult(error="HTTP 500", ttft=0.1, e2e=0.2),  # failed after a first token: still a miss
    ]


def test_goodput_counts_requests_meeting_every_target_over_the_duration():
    metrics = summarize(records(), duration=4.0, goodput={"ttft": 1000, "tpot": 50})
    assert metrics.slo_attainment == pytest.approx(3 / 8)  # 1st, 4th, 5th of 8 offered
    assert metrics.request_goodput == pytest.approx(3 / 4.0)
    with_e2e = summarize(records(), duration=4.0, goodput={"ttft": 1000, "tpot": 50, "e2el": 3000})
    assert with_e2e.request_goodput == pytest.approx(2 / 4.0)  # the 5th misses e2el
    ttft_only = summarize(records(), duration=4.0, goodput={"ttft": 1000})
    assert ttft_only.request_goodput == pytest.approx(4 / 4.0)  # the TPOT miss counts now
    assert summarize(records(), duration=4.0).goodput_targets_ms == {"ttft": 1000.0, "tpot": 50.0}


def test_percentiles_over_offered_requests_rank_a_failure_as_infinitely_slow():
    ok = [RequestResult(**OK, output_tokens=2, ttft=0.01 * (i + 1), e2e=1.0) for i in range(97)]
    failed = [RequestResult(error="HTTP 429") for _ in range(3)]
    metrics = summarize(ok + failed, duration=10.0)
    offered = metrics.latency_ms_offered["ttft"]
    assert offered["p50"] == pytest.approx(500.0) and offered["p90"] == pytest.approx(900.0)
    assert math.isinf(offered["p99"])  # 3% failed: the p99 request did not complete
    assert metrics.latency_ms["ttft"].p99 < 1000  # the completed requests alone hide the failures
    assert metrics.to_json()["latency_ms_offered"]["ttft"]["p99"] == "inf"  # JSON has no inf
    assert metrics.latency_ms_offered["tpot"]["p50"] == pytest.approx(520.0)  # the 50th of 30..990 ms


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        code = main(["bench", "serve", "--url", "http://127.0.0.1:9", *argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--goodput", "ttft=1000"], "'ttft=1000' is not KEY:VALUE; give targets as ttft:1000 tpot:50"),
        (["--goodput", "itl:50"], "unknown metric 'itl' in 'itl:50'; use ttft, tpot, e2el"),
        (["--goodput", "ttft:fast"], "'fast' in 'ttft:fast' is not a number of milliseconds"),
        (["--goodput", "tpot:-5"], "the tpot target must be a positive number of ms, got '-5'"),
        (["--goodput", "ttft:1", "ttft:2"], "the ttft target is given twice"),
        (["--goodput", "ttft:1000", "--slo-ttft-ms", "300"], "the ttft target is given twice"),
        (["--request-rates", "2:1:0.5"], "'2:1:0.5': a range is START:STOP:STEP, finite, STEP > 0"),
        (["--request-rates", "1,fast"], "'fast' is not a rate or START:STOP:STEP"),
    ],
)
def test_bad_targets_and_rates_are_one_line_errors(argv, message, capsys):
    code, last_line = run_cli(argv, capsys)
    assert code == 2
    assert last_line.startswith(("llmserve bench serve: error:", "llmserve: error:")) and message in last_line


def test_goodput_pairs_and_their_alias_flags():
    assert goodput_targets([("ttft", 1000.0), ("tpot", 50.0)]) == {"ttft": 1000.0, "tpot": 50.0}
    assert goodput_targets(None, {"ttft": 300.0, "tpot": None}) == {"ttft": 300.0}
    assert goodput_targets([("e2el", 5000.0)], {"tpot": 40.0}) == {"e2el": 5000.0, "tpot": 40.0}
    assert goodput_targets(None, {"ttft": None, "tpot": None}) == {"ttft": 1000.0, "tpot": 50.0}


def test_rates_as_a_list_a_range_or_both():
    assert rate_list("1:2:0.25") == [1.0, 1.25, 1.5, 1.75, 2.0]
    assert rate_list("0.5,1:2:0.5,inf") == [0.5, 1.0, 1.5, 2.0, math.inf]
    assert rate_list("1.0,1.25,1.5") == [1.0, 1.25, 1.5]
