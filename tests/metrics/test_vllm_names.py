"""Every series exported under vLLM's names, diffed against vLLM's documented metric names
(vllm_metric_names.txt): each one is exported, or is listed as not applying with the reason."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.metrics.helpers import fed_metrics

NAMES_FILE = Path(__file__).with_name("vllm_metric_names.txt")
LLMSERVE_ONLY = {  # exported under vllm: as well, for one scrape config, but vLLM has no such series
    "vllm:spec_decode_mean_accepted_length",
    "vllm:num_preemptions_by_mode",
    "vllm:swapped_out_blocks",
    "vllm:swapped_in_blocks",
    "vllm:iteration_batch_size",
    "vllm:kv_offload_hits",  # llmserve's RAM / disk tiers (vLLM counts its connector's under external_*)
    "vllm:kv_offload_bytes",
    "vllm:kv_offload_load_seconds",
    "vllm:lora_requests_running",  # per adapter (vLLM has only lora_requests_info's joined names)
    "vllm:lora_requests_waiting",
    "vllm:lora_prompt_tokens",  # tokens and latencies per adapter
    "vllm:lora_generation_tokens",
    "vllm:lora_time_to_first_token_seconds",
    "vllm:lora_e2e_request_latency_seconds",
}


def test_lora_requests_info_names_the_adapters_as_vllm_does():
    (sample,) = scraped_families(fed_metrics())["vllm:lora_requests_info"].samples
    assert {k: v for k, v in sample.labels.items() if k != "model_name"} == {
        "max_lora": "4",
        "waiting_lora_adapters": "chat",
        "running_lora_adapters": "sql",
    }
    assert sample.value > 1e9  # the time of the scrape, as vLLM's gauge holds


def vllm_names() -> tuple[set[str], dict[str, str]]:
    """(names llmserve must export, names that do not apply -> why), from the committed list."""
    exported, not_applicable = set(), {}
    for line in NAMES_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, _, reason = line.partition("  n/a: ")
        (not_applicable.__setitem__(name.strip(), reason) if reason else exported.add(name.strip()))
    return exported, not_applicable


def scraped_families(metrics) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}


def test_vllm_names_are_exported_or_said_not_to_apply():
    expected, not_applicable = vllm_names()
    families = scraped_families(fed_metrics())
    ours = {name for name in families if name.startswith("vllm:")}
    assert not expected - ours, f"vLLM metrics missing under vllm: {sorted(expected - ours)}"
    assert not ours & set(not_applicable), "listed as not applying but exported"
    assert all(reason.strip() for reason in not_applicable.values())
    assert ours - expected == LLMSERVE_ONLY, f"exported under vllm: but not vLLM's: {sorted(ours - expected)}"


def test_every_series_is_exported_under_both_prefixes_with_the_model_name():
    families = scraped_families(fed_metrics(model_name="SmolLM2-135M-Instruct"))
    llmserve = {name.removeprefix("llmserve:") for name in families if name.startswith("llmserve:")}
    vllm = {name.removeprefix("vllm:") for name in families if name.startswith("vllm:")}
    assert llmserve == vllm and len(llmserve) > 30
    samples = [s for family in families.values() for s in family.samples]
    assert all(s.labels.get("model_name") == "SmolLM2-135M-Instruct" for s in samples)
    for name in ("generation_tokens_total", "num_requests_running"):
        (a,) = [s.value for s in samples if s.name == "llmserve:" + name]
        (b,) = [s.value for s in samples if s.name == "vllm:" + name]
        assert a == b > 0


def test_one_prefix_only_when_asked():
    names = set(scraped_families(fed_metrics(metric_names="vllm")))
    assert names and all(name.startswith("vllm:") for name in names)
