"""Speculative decoding: batch-1 latency per method and throughput with speculation off, on and auto.

Latency: each prompt alone on the engine (batch 1), greedy, timed from its first token to its last,
so ms per output token is the decode cost without the prefill. Every method has its own engine, all
loaded at once, and each prompt runs on all of them back to back (in an order that rotates from
prompt to prompt), so a machine whose speed drifts over minutes slows every method alike. Two
workloads: input-grounded (summarize, rewrite or extract from a document cut from the real text of
workload.py, where the answer quotes its input and prompt lookup shines) and open-ended chat (where
it cannot). Every method must produce the tokens of no speculation (`matching_outputs`); the speedup
is none's ms per token over the method's.

Throughput: waves of B grounded requests of a fixed length (EOS ignored), for B in e.g. 1, 4, 16, 64,
through three engines that differ only in speculation: off, on (never disabled) and auto (off while
more than `--speculative-disable-batch-size` requests run). Only decode steps are timed (prefill is
the same work in every mode), each cell runs several times with the three modes back to back, and
the tables give medians, so slow drift of a shared machine hits all three alike.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from llmserve.benchmarks.workload import TokenCorpus, greedy_params
from llmserve.outputs import SpecDecodeStats
from llmserve.sampling_params import SamplingParams

GROUNDED_TASKS = (
    "Summarize the document above in a few sentences.",
    "Rewrite the document above in simpler words, keeping every fact.",
    "List every function, class or option the document above names, quoting each exactly.",
    "Answer from the document above only: what does it say the reader should do?",
)
CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good ways to learn a new language as an adult?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me ideas for a birthday party for my grandmother.",
    "What should I pack for a week of hiking in the mountains?",
    "Describe your ideal weekend.",
    "How do I make a simple tomato sauce?",
    "Write a poem about autumn leaves.",
    "What is a good routine for studying for exams?",
    "Write a letter to a friend who moved to another country.",
    "How does a lock and key actually work?",
    "Invent three new flavours of ice cream and describe them.",
    "Should I repair my old laptop or buy a new one?",
    "Invent a legend about how the moon got its craters.",
    "How can I be more patient with my children?",
    "Explain how a sailboat can move against the wind.",
    "How do I choose a good flat to rent in a new city?",
    "Compose a toast for my sister's wedding.",
    "Why does bread go stale?",
    "What are some easy houseplants for a dark apartment?",
    "Describe the view from the top of a lighthouse at dawn.",
    "How do I ask my manager for a raise?",
    "Write a short fable about a fox and a crow who share a secret.",
    "How do I teach a teenager to cook five simple meals?",
    "Why do some people find mathematics beautiful?",
    "Give me advice for my first day at university.",
    "Write a speech for a retiring school bus driver.",
    "How do I keep my bicycle in good shape?",
    "What are some fun things to do on a snowy day?",
    "Write a diary entry from the point of view of an old tree.",
    "How can a small town attract more visitors?",
    "What should I think about before adopting a dog?",
)
LATENCY_COLUMNS = (
    "workload", "method", "ms_per_token", "speedup", "acceptance_rate", "mean_accepted_length",
    "output_tokens", "matching_outputs",
)  # fmt: skip
THROUGHPUT_COLUMNS = (
    "batch_size", "mode", "output_tok_s", "speedup", "speedup_min", "speedup_max", "acceptance_rate",
    "repeats",
)  # fmt: skip


@dataclass(frozen=True)
class Method:
    """A speculation setting to measure: its label and the engine arguments that select it."""

    name: str  # "none", "ngram", "early_exit:15", "draft", "draft_head", "draft_head_only", "suffix"
    engine_kwargs: dict


def methods(names: Sequence[str], early_exit_layers: Sequence[int | None], draft_model: str | None) -> list:
    """The methods to measure, "none" first (the baseline); early_exit once per depth."""
    result = [Method("none", {"speculative_method": None})]
    for name in names:
        if name in ("ngram", "suffix"):
            result.append(Method(name, {"speculative_method": name}))
        elif name == "early_exit":
            for layers in early_exit_layers:
                label = "early_exit" if layers is None else f"early_exit:{layers}"
                kwargs = {"speculative_method": "early_exit", "speculative_draft_layers": layers}
                result.append(Method(label, kwargs))
        elif name == "draft":
            if not draft_model:
                raise ValueError("method draft needs --speculative-draft-model")
            kwargs = {"speculative_method": "draft", "speculative_draft_model": draft_model}
            result.append(Method("draft", kwargs))
        elif name == "draft_head":
            result.append(Method("draft_head", {"speculative_method": "draft_head"}))
        elif name == "draft_head_only":  # the head alone, without prompt lookup
            kwargs = {"speculative_method": "draft_head", "prompt_lookup_max": 0}
            result.append(Method("draft_head_only", kwargs))
        elif name == "eagle":  # the draft head as a token tree
            result.append(Method("eagle", {"speculative_method": "eagle"}))
        elif name != "none":
            raise ValueError(
                "--methods takes none, ngram, early_exit, draft, draft_head, draft_head_only, suffix and "
                f"eagle; got {name!r}"
            )
    return result


# -- workloads ----------------------------------------------------------------------------------------


def grounded_prompts(tokenizer, corpus: TokenCorpus, count: int, document_len: int, seed: int) -> list:
    """Chat prompts of a real-text document followed by a task that draws on it."""
    rng = np.random.default_rng(seed)
    prompts = []
    for index in range(count):
        document, _ = corpus.prompt(rng, document_len)
        task = GROUNDED_TASKS[index % len(GROUNDED_TASKS)]
        prompts.append(_chat(tokenizer, f"{document.strip()}\n\n{task}"))
    return prompts


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    return [_chat(tokenizer, CHAT_PROMPTS[i % len(CHAT_PROMPTS)]) for i in range(count)]


def _chat(tokenizer, content: str) -> list[int]:
    """The model's chat template around one user message, or the plain text without a template."""
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}])
    except ValueError:
        return tokenizer.encode(content)


# -- batch-1 latency ---------------------------------------------------------------------------------


@dataclass
class LatencyResult:
    workload: str
    method: str
    requests: int
    output_tokens: int
    decode_seconds: float  # first token to last, summed over the requests
    num_draft_tokens: int
    num_accepted_tokens: int
    num_drafts: int
    matching_outputs: int | None = None  # requests whose tokens equal no speculation's
    speedup: float | None = None  # none's ms per token over this method's

    @property
    def ms_per_token(self) -> float:
        """Decode time per token after the first (the first token's cost is the prefill's)."""
        return 1e3 * self.decode_seconds / max(self.output_tokens - self.requests, 1)

    @property
    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "ms_per_token": self.ms_per_token,
            "acceptance_rate": self.stats.acceptance_rate,
            "mean_accepted_length": self.stats.mean_accepted_length,
        }


def measure_latency(
    llms: dict, workload: str, prompts: Sequence[list[int]], max_tokens: int
) -> dict[str, tuple[LatencyResult, list[list[int]]]]:
    """Each prompt alone on every engine in `llms` (method name -> LLM), greedy, stopping at EOS or
    `max_tokens`; per method its result and its tokens. The methods take turns prompt by prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    names = list(llms)
    seconds = dict.fromkeys(names, 0.0)
    stats = {name: SpecDecodeStats() for name in names}
    tokens: dict[str, list[list[int]]] = {name: [] for name in names}
    for index, prompt in enumerate(prompts):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            (output,) = llms[name].generate([prompt], params, use_tqdm=False)
            seconds[name] += output.metrics.finished_time - output.metrics.first_token_time
            stats[name] = stats[name] + (output.spec_decode or SpecDecodeStats())
            tokens[name].append(list(output.outputs[0].token_ids))
    return {
        name: (
            LatencyResult(
                workload=workload,
                method=name,
                requests=len(prompts),
                output_tokens=sum(map(len, tokens[name])),
                decode_seconds=seconds[name],
                num_draft_tokens=stats[name].num_draft_tokens,
                num_accepted_tokens=stats[name].num_accepted_tokens,
                num_drafts=stats[name].num_drafts,
            ),
            tokens[name],
        )
        for name in names
    }


def compare_to_baseline(result: LatencyResult, baseline: LatencyResult, tokens, baseline_tokens) -> None:
    """Fill in the speedup over no speculation and how many outputs equal its tokens."""
    result.speedup = baseline.ms_per_token / result.ms_per_token
    result.matching_outputs = sum(a == b for a, b in zip(tokens, baseline_tokens, strict=True))


# -- throughput -----------------------------------------------------------------------------------------


@dataclass
class ThroughputResult:
    """One wave's decode: only steps that computed no prompt tokens count (prefill is the same work
    whatever the mode, and in a short wave it would hide the decode difference)."""

    mode: str  # "off", "on" or "auto"
    batch_size: int
    repeat: int
    output_tokens: int  # generated in decode-only steps
    seconds: float  # those steps' time
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


@dataclass
class ThroughputSummary:
    """The median over repeats of one (batch size, mode) cell, and of its ratio to "off" in the same
    repeat (the modes of a repeat run back to back, so machine drift hits them alike)."""

    batch_size: int
    mode: str
    repeats: int
    output_tok_s: float  # median
    speedup: float  # median of (this mode / off) per repeat
    speedup_min: float
    speedup_max: float
    acceptance_rate: float
    output_tokens: int  # per wave (decode-only steps)

    def to_json(self) -> dict:
        return asdict(self)


def measure_throughput(
    llm, mode: str, prompts: Sequence[list[int]], batch_size: int, output_len: int, repeat: int = 0
) -> ThroughputResult:
    """One wave of `batch_size` requests (the prompts cycled), each exactly `output_len` tokens."""
    engine = llm.engine
    for index in range(batch_size):
        request_id = f"spec-bench-{next(_request_ids)}"
        engine.add_request(request_id, prompts[index % len(prompts)], greedy_params(output_len))
    result = ThroughputResult(mode, batch_size, repeat, 0, 0.0, 0, 0)
    while engine.has_unfinished_requests():
        engine.step()
        step = engine.last_step
        if step is None or step.num_prompt_tokens:
            continue
        result.output_tokens += step.num_generation_tokens
        result.seconds += step.step_seconds
        result.num_draft_tokens += step.num_draft_tokens
        result.num_accepted_tokens += step.num_accepted_tokens
    return result


_request_ids = itertools.count()


def run_throughput(
    engines: dict[str, object], prompts, config: SpecBenchConfig, progress=print
) -> list[ThroughputResult]:
    """Every batch size `config.throughput_repeats` times; within a repeat the modes run back to back
    in an order that rotates between repeats, so none always runs first or last."""
    modes = list(engines)
    results = []
    for repeat in range(config.throughput_repeats):
        for batch_size in config.batch_sizes:
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                results.append(
                    measure_throughput(
                        engines[mode], mode, prompts, batch_size, config.throughput_output_len, repeat
                    )
                )
            progress(f"throughput repeat {repeat + 1}, batch {batch_size}: " + ", ".join(
                f"{r.mode} {r.output_tok_s:.1f}" for r in results[-len(modes):]
            ))  # fmt: skip
    return results


def summarize_throughput(results: Sequence[ThroughputResult]) -> list[ThroughputSummary]:
    """Medians per (batch size, mode), ratios against "off" of the same repeat."""
    off = {(r.batch_size, r.repeat): r.output_tok_s for r in results if r.mode == "off"}
    cells: dict[tuple[int, str], list[ThroughputResult]] = {}
    for result in results:
        cells.setdefault((result.batch_size, result.mode), []).append(result)
    summaries = []
    for (batch_size, mode), runs in sorted(cells.items()):
        ratios = [
            r.output_tok_s / off[(batch_size, r.repeat)] for r in runs if off.get((batch_size, r.repeat))
        ]
        drafted = sum(r.num_draft_tokens for r in runs)
        summaries.append(
            ThroughputSummary(
                batch_size=batch_size,
                mode=mode,
                repeats=len(runs),
                output_tok_s=statistics.median(r.output_tok_s for r in runs),
                speedup=statistics.median(ratios) if ratios else 0.0,
                speedup_min=min(ratios, default=0.0),
                speedup_max=max(ratios, default=0.0),
                acceptance_rate=sum(r.num_accepted_tokens for r in runs) / drafted if drafted else 0.0,
                output_tokens=runs[0].output_tokens,
            )
        )
    return summaries


def warm_up(llm, prompt: Sequence[int]) -> None:
    """First-call costs (allocations, kernel selection, the KV pool's prefault) are nobody's speculation."""
    llm.engine.model_runner.wait_for_kv_prefault()
    llm.generate([list(prompt)[:32]], greedy_params(8), use_tqdm=False)


# -- the whole benchmark ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecBenchConfig:
    methods: tuple[Method, ...]  # "none" first
    throughput_method: str  # the method measured on / auto in the throughput part ("" skips it)
    num_prompts: int = 32  # per latency workload (per-prompt speedups spread widely: 8 is too few)
    document_len: int = 400  # tokens of each grounded prompt's document
    max_tokens: int = 128  # latency: at most this many tokens (EOS ends earlier)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    throughput_output_len: int = 128
    throughput_repeats: int = 3  # waves per (batch size, mode); the tables give medians
    seed: int = 0


def same_kernels(engine_args) -> dict:
    """The engines' arguments, batch invariance decided once for all: speculation keeps its default off
    (worker/batch_invariance.py), so the baseline runs the same kernels and its tokens are the others'
    reference (with it on, prompts take other attention kernels: near ties part the outputs)."""
    deterministic = False if engine_args.deterministic is None else engine_args.deterministic
    return {**asdict(engine_args), "deterministic": deterministic}


def run_benchmark(engine_args, config: SpecBenchConfig, progress=print) -> dict:
    """Every method on both workloads at batch 1, then throughput off / on / auto; JSON-ready."""
    from llmserve import LLM

    common = same_kernels(engine_args)
    base = {**common, "speculative_disable_batch_size": 0}
    progress(f"loading {len(config.methods)} engines: {', '.join(m.name for m in config.methods)}")
    llms = {method.name: LLM(**{**base, **method.engine_kwargs}) for method in config.methods}
    tokenizer = next(iter(llms.values())).tokenizer
    workloads = _workloads(tokenizer, config)
    throughput_prompts = _throughput_prompts(tokenizer, config)
    for llm in llms.values():
        warm_up(llm, workloads["grounded"][0])
    by_workload = {}
    for name, prompts in workloads.items():
        progress(f"latency: {name} ({len(prompts)} prompts, the methods in turn)")
        by_workload[name] = results = measure_latency(llms, name, prompts, config.max_tokens)
        baseline, baseline_tokens = results["none"]
        for result, tokens in results.values():
            compare_to_baseline(result, baseline, tokens, baseline_tokens)
    latency = [by_workload[w][m.name][0] for m in config.methods for w in workloads]
    del llms
    throughput: list[ThroughputSummary] = []
    limit = engine_args.speculative_disable_batch_size
    method = next((m for m in config.methods if m.name == config.throughput_method), None)
    if method is not None:
        engines = {
            "off": LLM(**{**base, "speculative_method": None}),
            "on": LLM(**{**base, **method.engine_kwargs}),
            "auto": LLM(**{**common, **method.engine_kwargs}),
        }
        limit = engines["auto"].engine.config.speculative.disable_batch_size  # as the flag resolved
        progress(f"throughput {method.name}: off, on, auto (off above {limit or 'no number of'} requests)")
        for llm in engines.values():
            warm_up(llm, throughput_prompts[0])
        throughput = summarize_throughput(run_throughput(engines, throughput_prompts, config, progress))
    return {
        "latency": [r.to_json() for r in latency],
        "throughput": [r.to_json() for r in throughput],
        "auto_disable_batch_size": limit,
        "throughput_method": config.throughput_method,
        "throughput_repeats": config.throughput_repeats,
    }


def _workloads(tokenizer, config: SpecBenchConfig) -> dict[str, list[list[int]]]:
    corpus = TokenCorpus(tokenizer)
    return {
        "grounded": grounded_prompts(tokenizer, corpus, config.num_prompts, config.document_len, config.seed),
        "chat": chat_prompts(tokenizer, config.num_prompts),
    }


def _throughput_prompts(tokenizer, config: SpecBenchConfig) -> list[list[int]]:
    """A distinct grounded prompt per request of the largest wave (no prefix-cache or copy effects)."""
    count = max(config.batch_sizes, default=0)
    return grounded_prompts(tokenizer, TokenCorpus(tokenizer), count, config.document_len, config.seed + 1)


def plot_spec_decode(payload: dict, path) -> None:
    """Per method and workload: ms per token and the speedup; per batch size, the throughput."""
    from llmserve.benchmarks.table_plot import TablePanel, plot_table

    latency = payload["latency"]
    panels = [
        TablePanel("latency per token", latency, ["workload", "method"], "ms_per_token"),
        TablePanel("speedup over no speculation", latency, ["workload", "method"], "speedup"),
    ]
    if payload["throughput"]:
        panels.append(TablePanel("throughput", payload["throughput"], ["mode", "batch_size"], "output_tok_s"))
    plot_table(panels, path)
