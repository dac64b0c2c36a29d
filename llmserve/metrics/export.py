"""The server's series as Prometheus scrapes them: every family of the private `llmserve:` registry,
with a `model_name` label on every sample, under each exported prefix (`llmserve:` and vLLM's `vllm:`
by default), so dashboards, autoscalers and routers written for vLLM read llmserve unchanged.

The registry itself stays label-free and prefix-fixed (metrics/prometheus.py declares `llmserve:*`);
the names and the label are added here, at scrape time, so a metric declared once is exported the
same way under every name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

SOURCE_PREFIX = "llmserve:"
METRIC_NAME_CHOICES = ("both", "llmserve", "vllm")  # --metric-names
PREFIXES = {"both": ("llmserve:", "vllm:"), "llmserve": ("llmserve:",), "vllm": ("vllm:",)}


class ExportedSeries(Collector):
    """`source`'s families, renamed to each of `prefixes` and labelled with the served model."""

    def __init__(self, source: CollectorRegistry, model_name: str, prefixes: Sequence[str]) -> None:
        self.source = source
        self.model_name = model_name
        self.prefixes = tuple(prefixes)

    def describe(self) -> list[Metric]:
        return []  # the rank series are known only at scrape time

    def collect(self) -> list[Metric]:
        families = list(self.source.collect())
        return [renamed(family, prefix, self.model_name) for prefix in self.prefixes for family in families]


def renamed(family: Metric, prefix: str, model_name: str) -> Metric:
    """`family` under `prefix` (in place of `llmserve:`), each sample with `model_name` added."""
    name = prefix + family.name.removeprefix(SOURCE_PREFIX)
    copy = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue  # creation timestamps double the series; no dashboard reads them (vLLM drops them)
        sample_name = prefix + sample.name.removeprefix(SOURCE_PREFIX)
        labels = {"model_name": model_name, **sample.labels}
        copy.add_sample(sample_name, labels, sample.value, sample.timestamp, sample.exemplar)
    return copy


def exposition_registry(source: CollectorRegistry, model_name: str, names: str = "both") -> CollectorRegistry:
    """A registry whose scrape is `source` exported under the prefixes `names` chooses."""
    if names not in PREFIXES:
        raise ValueError(f"metric names must be one of {', '.join(METRIC_NAME_CHOICES)}, got {names!r}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExportedSeries(source, model_name, PREFIXES[names]))
    return registry


def metric_names(families: Iterable[Metric], prefix: str) -> set[str]:
    """The family names under `prefix` (counters without their `_total`, as the parser gives them)."""
    return {family.name for family in families if family.name.startswith(prefix)}
