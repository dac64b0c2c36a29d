"""docs/grafana/llmserve-dashboard.json both ways: every metric its queries name is on a running server's
/metrics, and every metric operators asked for (preemption modes, swapping, TPOT, request lengths,
parameters, per-position acceptance) has a panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "llmserve-dashboard.json"
OPERATOR_METRICS = {  # the part 4, as exported
    "llmserve:num_preemptions_by_mode_total",
    "llmserve:swapped_out_blocks_total",
    "llmserve:swapped_in_blocks_total",
    "llmserve:num_requests_swapped",
    "llmserve:cpu_cache_usage_perc",
    "llmserve:request_time_per_output_token_seconds",
    "llmserve:request_prompt_tokens",
    "llmserve:request_generation_tokens",
    "llmserve:request_max_num_generation_tokens",
    "llmserve:request_params_n",
    "llmserve:request_params_max_tokens",
    "llmserve:spec_decode_num_accepted_tokens_per_pos_total",
}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def queried_metrics() -> dict[str, set[str]]:
    """Panel title -> the metric names its queries read (suffixes such as _bucket kept)."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    panels = {p["title"]: {t["expr"] for t in p["targets"]} for p in dashboard["panels"]}
    panels["variables"] = set(variables)
    return {
        title: set(re.findall(r"llmserve:[A-Za-z0-9_]+", " ".join(exprs))) for title, exprs in panels.items()
    }


def exported_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


@pytest.mark.server
def test_every_queried_metric_is_on_a_running_servers_metrics(server):
    exported = exported_names(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
    missing = {title: names - exported for title, names in queried_metrics().items() if names - exported}
    assert not missing, missing


def test_every_operator_metric_has_a_panel():
    queried = set().union(*queried_metrics().values())
    stems = {re.sub(r"_(bucket|sum|count)$", "", name) for name in queried}
    assert not OPERATOR_METRICS - stems, sorted(OPERATOR_METRICS - stems)
