"""The CUDA path's proof on a GPU (issue 53): one prepared script for the minutes a device is lent. It
prints each section's figures as they come, a table of measured against floor and target at the end,
and writes every figure to DIR/cuda_check.json (DIR/tests.log: the kernel tests' output).

    python -m benchmarks.tools.cuda_check --write-bundle .devbundle  # here, once: the tokenizer
    python -m benchmarks.tools.cuda_check --bundle .devbundle --out DIR  # on the device
    python -m benchmarks.tools.cuda_check --smoke --out DIR  # anywhere, in seconds

Sections (docs/gpu.md: the command, what to carry, the targets):
  env     versions, the device, and the ceilings measured on it: device-to-device copy GB/s (bytes
          read and written) and an 8192^3 bf16 matmul's TFLOP/s, each the median of CUDA-event times
  tests   the Triton kernel tests compiled for the GPU: pytest with LLMSERVE_TEST_DEVICE=cuda and no
          TRITON_INTERPRET, bfloat16 included
  greedy  `LLM` on CUDA in float32 (TF32 off) against transformers' greedy generate on the same GPU,
          a random Llama-shape model with GQA, one batch of prompts of 5 to 500 tokens
  lora    the same model with a random adapter over every linear layer: LLM's greedy tokens against
          transformers' on the merged weights (and on the bare ones for prompts under no adapter)
  speed   a random model of Llama-3.2-1B's shape in bfloat16: decode time per step at batch 1, 32
          and 128 with 1k and 4k contexts against the memory floor (weights plus the KV read, over
          the copy bandwidth); 2k-token prefill against the FLOP ceiling; kernels, launches and host
          syncs per decode step; start-up to the first token
  quantized `--quantization int4` (RTN at load) on the device's quantized layers (the Triton kernel):
          the greedy model's tokens against a float32 run of the weights those layers hold; the speed
          model's decode at batch 1 and 32 against the floor of its bytes
Each section runs in its own try: a failure prints its traceback's tail and the others go on. The
tokenizer is the embedded default model's (SmolLM2's), carried as the small folder --write-bundle
writes (the GGUF is too large to carry); weights are random, made where the check runs. --smoke runs
every section's code on tiny shapes on the CPU (a section that needs CUDA says it was skipped):
tests/benchmarks/test_cuda_check.py runs it in the normal suite.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[2]
TEST_FILES = (
    "tests/attention/test_triton_paged_attention.py",
    "tests/kernels/test_triton_elementwise.py",
    "tests/kernels/test_triton_lora.py",
    "tests/kernels/test_triton_quantized_linear.py",
)
TEST_DEVICE_VARIABLE = "LLMSERVE_TEST_DEVICE"  # the Triton tests' device: cpu (interpreted) or cuda
TOKENIZER_VOCAB = 49152  # SmolLM2's tokens: ids past it decode to nothing (checked before use)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
COMMON_LLAMA = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5)
LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
# the targets, as ratios to the floors measured in the same run
TARGET_B1_FLOOR_RATIO = 2.0
TARGET_B128_BANDWIDTH = 0.6
TARGET_PREFILL_FLOPS = 0.5
TARGET_SYNCS_PER_STEP = 1.0
TARGET_GRAPH_START_SECONDS = 10.0
PREFILL_PATIENCE_S = 120.0  # a batch's prompts not all decoding by then: a scheduling or pool problem
# The speed engines schedule by the token budget alone (latency targets would cut prompt chunks
# short), and each takes under half the device: one whose memory outlived it leaves the next room.
QUANTIZED_METHOD = "int4"  # RTN at load: the layout a GGUF's Q4_0/Q4_1 blocks take too
SPEED_ENGINE = dict(ttft_target_ms=0, tpot_target_ms=0, gpu_memory_utilization=0.45)


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the device's, or tiny ones on the CPU (--smoke)."""

    device: str
    copy_bytes: int  # the copy's source (as many written)
    matmul_n: int
    greedy_model: dict  # LlamaConfig fields
    greedy_lengths: tuple[int, ...]  # prompt tokens
    greedy_new_tokens: int
    greedy_chunk: int  # the chunked run's token budget: prompts in chunks, mixed with decodes
    speed_model: dict
    speed_dtype: str
    max_model_len: int  # the speed engine's: the longest context and its decode steps
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int  # timed per batch and context
    prefill_prompts: int
    prefill_len: int
    count_batch: int  # the batch whose decode steps' kernels and syncs are counted
    count_context: int
    count_steps: int
    tests_timeout: float  # seconds the kernel tests may take
    budget: float  # seconds for the whole check: a late decode shape is skipped, not started
    engine_kwargs: dict = field(default_factory=dict)  # smoke: a small CPU pool


FULL = Plan(
    device="cuda",
    copy_bytes=2 << 30,
    matmul_n=8192,
    greedy_model=dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    greedy_lengths=(5, 17, 64, 128, 250, 333, 420, 500),
    greedy_new_tokens=24,
    greedy_chunk=128,
    speed_model=LLAMA_3_2_1B,
    speed_dtype="bfloat16",
    max_model_len=4096 + 512,
    decode_batches=(1, 32, 128),
    decode_contexts=(1024, 4096),
    decode_steps=24,
    prefill_prompts=16,
    prefill_len=2048,
    count_batch=32,
    count_context=1024,
    count_steps=5,
    tests_timeout=210.0,
    budget=390.0,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
SMOKE = Plan(
    device="cpu",
    copy_bytes=0,
    matmul_n=0,
    greedy_model=dict(TINY, vocab_size=TOKENIZER_VOCAB),
    greedy_lengths=(5, 40),
    greedy_new_tokens=4,
    greedy_chunk=16,
    speed_model=dict(TINY, vocab_size=TOKENIZER_VOCAB + 848),  # ids past the tokenizer's, as the 1B's
    speed_dtype="float32",
    max_model_len=128,
    decode_batches=(1, 4),
    decode_contexts=(16, 48),
    decode_steps=3,
    prefill_prompts=4,
    prefill_len=32,
    count_batch=4,
    count_context=16,
    count_steps=2,
    tests_timeout=0.0,
    budget=120.0,
    engine_kwargs=dict(kv_cache_memory="16MiB", max_num_batched_tokens=64),
)


class Run:
    """One check's plan, folders, results so far and deadline."""

    def __init__(self, plan: Plan, out: Path, bundle: Path, work: Path) -> None:
        self.plan, self.out, self.bundle, self.work = plan, out, bundle, work
        self.results: dict = {"plan": dataclasses.asdict(plan)}
        self.deadline = time.monotonic() + plan.budget

    @property
    def cuda(self) -> bool:
        return self.plan.device == "cuda"

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "cuda_check.json").write_text(json.dumps(self.results, indent=1, default=str))


def say(text: str) -> None:
    print(text, flush=True)


def skipped_without_cuda(run: Run) -> dict | None:
    if run.cuda and not torch.cuda.is_available():
        return {"status": "skipped: no CUDA device"}
    return None


# -- env: versions and ceilings ---------------------------------------------------------------------


def section_env(run: Run) -> dict:
    result = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: _version(name) for name in ("triton", "transformers", "tokenizers", "msgspec")},
        "commit": _commit(),
    }
    say("  " + ", ".join(f"{k} {v}" for k, v in result.items()))
    if not (run.cuda and torch.cuda.is_available()):
        return {**result, "ceilings": "skipped: no CUDA device"}
    props = torch.cuda.get_device_properties(0)
    result.update(
        device=props.name, sm_count=props.multi_processor_count, memory_gib=props.total_memory / 2**30
    )
    result["copy_gb_s"] = copy_bandwidth(run.plan.copy_bytes) / 1e9
    result["matmul_tflop_s"] = matmul_flops(run.plan.matmul_n) / 1e12
    say(
        f"  {props.name}: {props.multi_processor_count} SMs, {result['memory_gib']:.1f} GiB; copy "
        f"{result['copy_gb_s']:.0f} GB/s, bf16 matmul {result['matmul_tflop_s']:.0f} TFLOP/s"
    )
    return result


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def cuda_median_seconds(call: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of `repeats` calls, each timed by CUDA events, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves, counting the bytes read and those written."""
    source = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    seconds = cuda_median_seconds(lambda: target.copy_(source))
    return 2 * num_bytes / seconds


def matmul_flops(n: int) -> float:
    """FLOP/s of an n x n x n bf16 matrix product on random data."""
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out = torch.empty_like(a)
    seconds = cuda_median_seconds(lambda: torch.mm(a, b, out=out))
    return 2 * n**3 / seconds


# -- tests: the Triton kernel tests, compiled ----------------------------------------------------------

_RESULT_LINE = re.compile(
    r"^(?:\[gw\d+\] \[\s*\d+%\] (?P<a>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<ida>\S+)"
    r"|(?P<idb>\S+::\S+) (?P<b>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)",
    re.MULTILINE,
)


def section_tests(run: Run) -> dict:
    if not (run.cuda and torch.cuda.is_available()):
        return {"status": "skipped: no CUDA device"}
    files = [name for name in TEST_FILES if (REPO / name).is_file()]
    missing = sorted(set(TEST_FILES) - set(files))
    log = run.out / "tests.log"
    returncode = run_pytest(files, log, run.plan.tests_timeout) if files else "no test files"
    counts = count_test_results(log.read_text(errors="replace") if files else "")
    say(
        f"  {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
        f"{counts['skipped']} skipped (bfloat16: {counts['bf16_passed']} passed, {counts['bf16_failed']} "
        f"failed); exit {returncode}" + (f"; missing: {', '.join(missing)}" if missing else "")
    )
    for name in counts["failed_ids"][:10]:
        say(f"  FAILED {name}")
    if returncode != 0 and files:  # a collection error or a crash names no test: the log's end does
        say("\n".join("  | " + line for line in log.read_text(errors="replace").splitlines()[-15:]))
    return {"files": files, "missing": missing, "returncode": returncode, **counts}


def run_pytest(files: list[str], log: Path, timeout: float) -> int | str:
    """pytest on `files` with the tests' device switched to CUDA, compiled (no interpreter), its
    output in `log`; the exit status, or "timeout" (its process group then killed)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env[TEST_DEVICE_VARIABLE] = "cuda"
    command = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *files]
    if _has_module("xdist"):  # Triton compiles each specialization on the CPU: spread them
        command += ["-n", str(min(8, os.cpu_count() or 1))]
    if _has_module("pytest_timeout"):
        command += ["--timeout", "120"]  # one hung kernel must not take the whole check
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # pytest and its xdist workers
            process.wait()
            return "timeout"


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def count_test_results(text: str) -> dict:
    """Results by outcome from pytest -v lines (with or without xdist), and bfloat16's apart."""
    outcomes: Counter[str] = Counter()
    failed_ids = []
    for match in _RESULT_LINE.finditer(text):
        outcome = (match["a"] or match["b"]).lower()
        test_id = match["ida"] or match["idb"]
        outcomes[outcome] += 1
        if "bfloat16" in test_id or "bf16" in test_id:
            outcomes[f"bf16_{outcome}"] += 1
        if outcome in ("failed", "error"):
            failed_ids.append(test_id)
    names = ("passed", "failed", "error", "skipped", "bf16_passed", "bf16_failed")
    return {**{name: outcomes[name] for name in names}, "failed_ids": failed_ids}


# -- models and prompts ------------------------------------------------------------------------------


def write_bundle(folder: Path) -> list[str]:
    """The embedded default model's tokenizer files (tokenizer.json, its config, chat template) in
    `folder`, for a machine that cannot carry the GGUF; the files written."""
    from llmserve.model_loader import default_model_path, load_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(str(folder))
    return sorted(path.name for path in folder.iterdir())


def model_dir(folder: Path, bundle: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """An HF Llama directory: config.json, model.safetensors and the bundle's tokenizer files."""
    import safetensors.torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    llama = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **COMMON_LLAMA, **config)
    llama.save_pretrained(str(folder))
    safetensors.torch.save_file(
        {k: v.contiguous().cpu() for k, v in weights.items()}, folder / "model.safetensors"
    )
    for path in bundle.iterdir():
        shutil.copy(path, folder / path.name)
    return folder


def random_weights(config: dict, dtype: torch.dtype, device: str, scale: float) -> dict[str, torch.Tensor]:
    """A Llama's weights by name, drawn on `device`: matrices normal with std scale / sqrt(fan-in),
    norms one. The names and shapes come from transformers' own class, built on the meta device."""
    import transformers

    with torch.device("meta"):
        shapes = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**COMMON_LLAMA, **config)
        ).state_dict()
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, meta in shapes.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if meta.dim() == 1:
            weights[name] = torch.ones(meta.shape, dtype=dtype, device=device)
            continue
        values = torch.randn(meta.shape, generator=generator, device=device, dtype=torch.float32)
        weights[name] = (values * (scale / math.sqrt(meta.shape[1]))).to(dtype)
    return weights


def corpus_prompts(tokenizer, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts of the given token counts, cut from the interpreter's own text at spread offsets."""
    from llmserve.corpus import corpus_text

    ids = tokenizer.encode(corpus_text()[:200_000], add_special_tokens=False)
    step = (len(ids) - max(lengths)) // len(lengths)
    return [ids[i * step : i * step + length] for i, length in enumerate(lengths)]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_summary(llm) -> dict:
    """What the engine resolved: the GPU-sized defaults, the pool, the attention backend."""
    config, runner = llm.engine.config, llm.engine.model_runner
    return {
        "device": str(config.model.device),
        "dtype": str(config.model.dtype),
        "attention_backend": getattr(
            runner.attention_backend, "name", type(runner.attention_backend).__name__
        ),
        "block_size": config.cache.block_size,
        "num_blocks": config.cache.num_blocks,
        "kv_cache_gib": config.cache.kv_cache_memory / 2**30,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
    }


# -- greedy: LLM against transformers -----------------------------------------------------------------


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """float32 matrix products in full precision (TF32 off) inside the block."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def section_greedy(run: Run) -> dict:
    """Greedy tokens of one batch (prompts in one step, decodes in graphs), then of small chunks
    under few sequences (chunked prefill mixed with decodes) run twice (prefix-cache hits)."""
    if (skip := skipped_without_cuda(run)) is not None:
        return skip
    import transformers

    from llmserve.model_loader import load_tokenizer

    plan = run.plan
    folder = greedy_folder(run)
    prompts = corpus_prompts(load_tokenizer(str(folder)), plan.greedy_lengths)
    chunked = dict(max_num_batched_tokens=plan.greedy_chunk, max_num_seqs=4)
    with exact_float32():
        hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(plan.device)
        expected = [hf_greedy(hf.eval(), prompt, plan.greedy_new_tokens) for prompt in prompts]
        del hf
        free_memory()
        runs = {
            "one batch": llm_greedy(folder, prompts, expected, plan, {}, passes=1),
            "chunked, then prefix hits": llm_greedy(folder, prompts, expected, plan, chunked, passes=2),
        }
    result = {
        "prompts": sum(r["compared"] for r in runs.values()),
        "equal": sum(r["equal"] for r in runs.values()),
        "prompt_tokens": [len(p) for p in prompts],
        "runs": runs,
    }
    say(f"  greedy tokens equal to transformers' for {result['equal']}/{result['prompts']} prompts")
    return result


def greedy_folder(run: Run) -> Path:
    """The greedy model's folder (float32 weights drawn large, so its logits are peaked), written once."""
    folder = run.work / "greedy"
    if not (folder / "model.safetensors").exists():
        weights = random_weights(run.plan.greedy_model, torch.float32, run.plan.device, scale=4.0)
        model_dir(folder, run.bundle, run.plan.greedy_model, weights)
    return folder


def llm_greedy(folder: Path, prompts, expected, plan: Plan, engine_kwargs: dict, passes: int) -> dict:
    """`LLM`'s greedy tokens for the prompts, `passes` times on one engine, against transformers'."""
    from llmserve import LLM, SamplingParams

    llm = LLM(str(folder), device=plan.device, dtype="float32", **{**plan.engine_kwargs, **engine_kwargs})
    params = SamplingParams(temperature=0, max_tokens=plan.greedy_new_tokens)
    mismatches = []
    for index in range(passes):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, output, (tokens, margins) in zip(prompts, outputs, expected, strict=True):
            difference = compare_greedy(output.outputs[0], tokens, margins)
            if difference:
                mismatches.append(dict(run=index, prompt_tokens=len(prompt), **difference))
    result = {
        "compared": passes * len(prompts),
        "equal": passes * len(prompts) - len(mismatches),
        "mismatches": mismatches,
        "engine": engine_summary(llm),
    }
    say(f"  {result['equal']}/{result['compared']} equal; engine {result['engine']}")
    for mismatch in mismatches:
        say(f"  MISMATCH {mismatch}")
    llm.shutdown()
    return result


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, at each, the margin of its best logit over the second."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        result = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=COMMON_LLAMA["pad_token_id"],
        )
    margins = [float(top[0] - top[1]) for top in (s[0].float().topk(2).values for s in result.scores)]
    return result.sequences[0, len(prompt) :].tolist(), margins


def compare_greedy(ours, theirs: list[int], margins: list[float]) -> dict:
    """{} where our tokens are transformers' (up to a stop both reach); else where they part and how
    close transformers' best two logits were there (a near tie is noise, not a bug)."""
    tokens = list(ours.token_ids)
    if tokens == theirs[: len(tokens)] and (len(tokens) == len(theirs) or ours.finish_reason == "stop"):
        return {}
    first = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=False)) if a != b), len(tokens))
    return {"first_difference": first, "hf_top2_margin": margins[first] if first < len(margins) else None}


# -- lora: adapters on the device against the merged weights -------------------------------------------

LORA_RANK = 8
LORA_TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def section_lora(run: Run) -> dict:
    """A random PEFT adapter over every linear layer of the greedy model: LLM's greedy tokens with it
    (every prompt under it in one batch; prompts alternately under it and the base in small chunks,
    so steps of a few rows take the LoRA kernel) against transformers' on the weights with the adapter
    merged (W + scale B A) and on the bare weights, float32 (TF32 off)."""
    if (skip := skipped_without_cuda(run)) is not None:
        return skip
    import transformers

    from llmserve import LLM, SamplingParams
    from llmserve.lora.request import LoRARequest
    from llmserve.model_loader import load_tokenizer

    plan = run.plan
    weights = random_weights(plan.greedy_model, torch.float32, plan.device, scale=4.0)
    base = model_dir(run.work / "lora-base", run.bundle, plan.greedy_model, weights)
    adapter, deltas = write_random_adapter(run.work / "lora-adapter", weights, plan.greedy_model)
    merged = {name: w + deltas[name] if name in deltas else w for name, w in weights.items()}
    merged_dir = model_dir(run.work / "lora-merged", run.bundle, plan.greedy_model, merged)
    prompts = corpus_prompts(load_tokenizer(str(base)), plan.greedy_lengths)
    params = SamplingParams(temperature=0, max_tokens=plan.greedy_new_tokens)
    request = LoRARequest("random", 1, str(adapter))
    alternate = [request if i % 2 == 0 else None for i in range(len(prompts))]
    runs = {}
    with exact_float32():
        expected = {}
        for name, folder in (("adapter", merged_dir), ("base", base)):
            hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(
                plan.device
            )
            expected[name] = [hf_greedy(hf.eval(), p, plan.greedy_new_tokens) for p in prompts]
            del hf
            free_memory()
        chunked = dict(max_num_batched_tokens=plan.greedy_chunk, max_num_seqs=4)
        for label, extra, requests in (
            ("one batch", {}, [request] * len(prompts)),
            ("alternate, chunked", chunked, alternate),
        ):
            kwargs = {**plan.engine_kwargs, **extra, "enable_lora": True, "max_lora_rank": LORA_RANK}
            llm = LLM(str(base), device=plan.device, dtype="float32", **kwargs)
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
            mismatches = []
            for index, (output, under) in enumerate(zip(outputs, requests, strict=True)):
                tokens, margins = expected["base" if under is None else "adapter"][index]
                difference = compare_greedy(output.outputs[0], tokens, margins)
                if difference:
                    mismatches.append(dict(prompt=index, adapter=under is not None, **difference))
            runs[label] = {
                "compared": len(prompts),
                "equal": len(prompts) - len(mismatches),
                "mismatches": mismatches,
            }
            say(f"  {label}: {runs[label]['equal']}/{len(prompts)} equal")
            for mismatch in mismatches:
                say(f"  MISMATCH {mismatch}")
            llm.shutdown()
            free_memory()
    changed = sum(a[0] != b[0] for a, b in zip(expected["adapter"], expected["base"], strict=True))
    result = {
        "prompts": sum(r["compared"] for r in runs.values()),
        "equal": sum(r["equal"] for r in runs.values()),
        "adapter_changes_tokens": f"{changed}/{len(prompts)} prompts",
        "runs": runs,
    }
    say(
        f"  LoRA greedy equal to the merged weights' for {result['equal']}/{result['prompts']}; "
        f"the adapter changes transformers' tokens for {changed}/{len(prompts)} prompts"
    )
    return result


def write_random_adapter(folder: Path, weights: dict[str, torch.Tensor], config: dict) -> tuple[Path, dict]:
    """A PEFT adapter of rank LORA_RANK over every linear layer (A and B normal, B scaled so the delta
    moves the greedy tokens), and each weight's delta scale * B A by its checkpoint name."""
    import safetensors.torch

    generator = torch.Generator().manual_seed(1)
    alpha = 2 * LORA_RANK
    tensors, deltas = {}, {}
    for layer in range(config["num_hidden_layers"]):
        for block, modules in LORA_TARGETS.items():
            for module in modules:
                name = f"model.layers.{layer}.{block}.{module}"
                fan_out, fan_in = weights[f"{name}.weight"].shape
                a = torch.randn(LORA_RANK, fan_in, generator=generator) / math.sqrt(fan_in)
                b = torch.randn(fan_out, LORA_RANK, generator=generator) / math.sqrt(LORA_RANK)
                tensors[f"base_model.model.{name}.lora_A.weight"] = a
                tensors[f"base_model.model.{name}.lora_B.weight"] = b
                deltas[f"{name}.weight"] = (alpha / LORA_RANK * (b @ a)).to(weights[f"{name}.weight"].device)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, folder / "adapter_model.safetensors")
    config_json = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": alpha,
        "target_modules": [m for modules in LORA_TARGETS.values() for m in modules],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config_json))
    return folder, deltas


# -- speed: a Llama-3.2-1B-shaped model in bfloat16 ---------------------------------------------------


def section_speed(run: Run) -> dict:
    if (skip := skipped_without_cuda(run)) is not None:
        return skip
    folder, config, note = speed_folder(run)
    result: dict = {"vocab_size": config["vocab_size"], "vocab_note": note}
    llm, result["startup"] = start_engine(run, folder, {})
    engine = llm.engine
    result["engine"] = engine_summary(llm)
    result["weight_bytes"] = sum(p.numel() * p.element_size() for p in engine.model_runner.model.parameters())
    say(f"  engine {result['engine']}; start-up {result['startup']}")
    result["decode"] = decode_grid(run, engine)
    result["prefill"] = measure_prefill(run, engine)
    result["counts"] = count_per_step(run, engine)
    llm.shutdown()
    del llm, engine
    free_memory()
    result["eager"] = eager_comparison(run, folder)
    return result


def speed_folder(run: Run) -> tuple[Path, dict, str | None]:
    """The speed model's folder (written once a check), its config, and why its vocabulary was cut, if
    it was (ids past the tokenizer's that it cannot decode)."""
    config, note = dict(run.plan.speed_model), None
    if not _decodes_past_vocabulary(run.bundle, config["vocab_size"]):
        config["vocab_size"], note = TOKENIZER_VOCAB, "the tokenizer fails on ids past its vocabulary"
    folder = run.work / "speed"
    if not (folder / "model.safetensors").exists():
        weights = random_weights(config, getattr(torch, run.plan.speed_dtype), run.plan.device, 1.0)
        model_dir(folder, run.bundle, config, weights)
        del weights
        free_memory()
    return folder, config, note


def _decodes_past_vocabulary(bundle: Path, vocab_size: int) -> bool:
    """Whether the tokenizer decodes ids up to `vocab_size` (past its own: random models' outputs)."""
    from llmserve.model_loader import load_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        for path in bundle.iterdir():
            shutil.copy(path, Path(folder) / path.name)
        (Path(folder) / "config.json").write_text(json.dumps({"model_type": "llama", **COMMON_LLAMA}))
        try:
            load_tokenizer(folder, (2,)).decode([vocab_size - 1, TOKENIZER_VOCAB + 7, 5])
        except Exception:  # noqa: BLE001 - any failure means: keep to the tokenizer's ids
            return False
    return True


def start_engine(run: Run, folder: Path, extra: dict):
    """An engine on the speed model, and its start-up: seconds to built, and to a first token."""
    from llmserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        str(folder),
        device=run.plan.device,
        dtype=run.plan.speed_dtype,
        max_model_len=run.plan.max_model_len,
        **SPEED_ENGINE,
        **run.plan.engine_kwargs,
        **extra,
    )
    built = time.perf_counter() - start
    llm.generate([[5] * 16], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter() - start
    return llm, {"built_s": built, "first_token_s": first_token, "engine_s": llm.engine.startup_seconds}


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


@dataclass
class DecodeTimes:
    step_s: list[float] = field(default_factory=list)  # the engine's step: schedule, run, outputs
    execute_s: list[float] = field(default_factory=list)  # the model runner's part (forward, sample)
    kv_tokens: list[int] = field(default_factory=list)  # tokens whose KV each step read


@contextlib.contextmanager
def timed_execute(engine) -> Iterator[list[float]]:
    """Seconds of each model-runner execute inside the block (it ends on the step's host sync)."""
    times: list[float] = []
    execute = engine.model_runner.execute

    def timed(plan):
        start = time.perf_counter()
        output = execute(plan)
        times.append(time.perf_counter() - start)
        return output

    with mock.patch.object(engine.model_runner, "execute", timed):
        yield times


def decoding(engine, batch: int, context: int, seed: int, max_model_len: int) -> list[str]:
    """Add `batch` random prompts of `context` tokens, then step until every one of them decodes in
    the same step (chunked prefills done); their request ids."""
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_model_len - context - 1)
    vocab = engine.config.model.arch.vocab_size
    ids = [f"d{batch}x{context}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, random_prompts(batch, context, vocab, seed), strict=True):
        engine.add_request(request_id, prompt, params)
    give_up = time.monotonic() + PREFILL_PATIENCE_S
    engine.step()
    while not _pure_decode(engine.last_step, batch):
        if time.monotonic() > give_up:
            raise RuntimeError(f"batch {batch} of {context}-token prompts never decoded in one step")
        engine.step()
    return ids


def _pure_decode(stats, batch: int) -> bool:
    return stats is not None and stats.num_prompt_tokens == 0 and stats.num_batched_seqs == batch


def time_decode(engine, steps: int) -> DecodeTimes:
    times = DecodeTimes()
    with timed_execute(engine) as execute:
        for _ in range(steps):
            times.kv_tokens.append(sum(r.num_computed_tokens for r in engine.scheduler.running))
            engine.step()
            times.step_s.append(engine.last_step.step_seconds)
    times.execute_s = execute
    return times


def finish(engine, request_ids: list[str]) -> None:
    for request_id in request_ids:
        engine.abort_request(request_id)


def decode_grid(run: Run, engine) -> list[dict]:
    rows = []
    for batch in run.plan.decode_batches:
        for context in run.plan.decode_contexts:
            if run.seconds_left() < 60 and run.cuda:
                rows.append({"batch": batch, "context": context, "status": "skipped: time budget"})
                continue
            ids = decoding(
                engine, batch, context, seed=batch * 10007 + context, max_model_len=run.plan.max_model_len
            )
            times = time_decode(engine, run.plan.decode_steps)
            finish(engine, ids)
            rows.append(decode_row(engine, batch, context, times))
            say(f"  decode {rows[-1]}")
    return rows


def decode_row(engine, batch: int, context: int, times: DecodeTimes, weight_bytes: int | None = None) -> dict:
    """Median step and execute times, and the step's bytes: the weights once (the parameters', unless
    given), every KV entry read."""
    config = engine.config
    kv_bytes = config.model.arch.kv_bytes_per_token(config.model.dtype, config.cache.kv_cache_dtype)
    if weight_bytes is None:
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model_runner.model.parameters())
    return {
        "batch": batch,
        "context": context,
        "step_ms": statistics.median(times.step_s) * 1e3,
        "execute_ms": statistics.median(times.execute_s) * 1e3,
        # tied embeddings: the output projection reads the whole embedding matrix every step
        "bytes_per_step": weight_bytes + kv_bytes * statistics.mean(times.kv_tokens),
    }


def measure_prefill(run: Run, engine) -> dict:
    """Prompt tokens per second of steps that only prefill (each a full token budget of prompts),
    and the FLOPs they did: the linear layers' 2 per weight per token, causal attention's, and the
    output projection's for each prompt's last token."""
    from llmserve import SamplingParams

    plan, arch = run.plan, engine.config.model.arch
    prompts = random_prompts(plan.prefill_prompts, plan.prefill_len, arch.vocab_size, seed=7)
    ids = [f"prefill-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    tokens, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step
        if stats is not None and stats.num_prompt_tokens:
            tokens, seconds = tokens + stats.num_prompt_tokens, seconds + stats.step_seconds
    flops = prefill_flops(arch, plan.prefill_len) * len(prompts)
    result = {"prompts": len(prompts), "prompt_len": plan.prefill_len, "tokens": tokens, "seconds": seconds}
    result.update(tokens_per_s=tokens / seconds, flop_per_s=flops / seconds)
    say(f"  prefill {result}")
    return result


def prefill_flops(arch, length: int) -> float:
    """FLOPs of one prompt's prefill in a Llama of `arch`."""
    hidden, q, kv = (
        arch.hidden_size,
        arch.num_attention_heads * arch.head_dim,
        arch.num_key_value_heads * arch.head_dim,
    )
    linear = hidden * (2 * q + 2 * kv) + 3 * hidden * arch.intermediate_size
    attention = 2 * q * length * (length + 1)  # QK^T and PV over the causal half, 2 FLOPs per product
    return arch.num_hidden_layers * (2 * linear * length + attention) + 2 * hidden * arch.vocab_size


def count_per_step(run: Run, engine) -> dict:
    """Per decode step: device kernels, memory copies and host launch and sync calls (profiler);
    and synchronizing operations as torch's sync debug mode reports them (CUDA only)."""
    plan = run.plan
    ids = decoding(engine, plan.count_batch, plan.count_context, seed=3, max_model_len=plan.max_model_len)
    counts = {
        "batch": plan.count_batch,
        "context": plan.count_context,
        **profile_steps(engine, plan.count_steps, run.cuda),
    }
    if run.cuda:
        counts["sync_warnings_per_step"] = sync_warnings(engine, plan.count_steps) / plan.count_steps
    finish(engine, ids)
    say(f"  per decode step {counts}")
    return counts


def profile_steps(engine, steps: int, cuda: bool) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    counts: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for event in prof.events():
        name = event.name
        if event.device_type == DeviceType.CUDA:
            kind = (
                "memcpy" if name.startswith("Memcpy") else "memset" if name.startswith("Memset") else "kernel"
            )
            counts[kind] += 1
            counts[name] += kind == "memcpy"  # by direction and memory kind
            kernels[name] += kind == "kernel"
        elif name in SYNC_CALLS:
            counts["host_syncs"] += 1
        elif "LaunchKernel" in name or name in ("cudaGraphLaunch", "cuLaunchKernel", "cuLaunchKernelEx"):
            counts["host_launches"] += 1
        elif name.startswith("aten::"):
            counts["aten_ops"] += 1
    per_step = {key: value / steps for key, value in counts.items() if value}
    per_step["top_kernels"] = [(name, n / steps) for name, n in kernels.most_common(12)]
    return per_step


def sync_warnings(engine, steps: int) -> int:
    """Synchronizing operations torch warns of while stepping (its sync debug mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def eager_comparison(run: Run, folder: Path) -> dict:
    """With --enforce-eager (once CUDA graphs exist): start-up, and batch-1 decode at the first
    context, so the graphs' gain and capture time show; the default engine started first, cold."""
    from llmserve.config import EngineArgs

    if "enforce_eager" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return {"status": "skipped: no --enforce-eager (no CUDA graphs yet)"}
    llm, startup = start_engine(run, folder, {"enforce_eager": True})
    context = run.plan.decode_contexts[0]
    ids = decoding(llm.engine, 1, context, seed=11, max_model_len=run.plan.max_model_len)
    times = time_decode(llm.engine, run.plan.decode_steps)
    finish(llm.engine, ids)
    result = {"startup": startup, "decode": decode_row(llm.engine, 1, context, times)}
    llm.shutdown()
    say(f"  enforce-eager {result}")
    return result


# -- quantized: weights in their codes on the device's kernel ------------------------------------------


def section_quantized(run: Run) -> dict:
    """`--quantization int4` (RTN at load: int4 decoder layers in groups of 32, an int8 output
    projection): which kernel its layers took; the greedy model's tokens against a float32 run of the
    weights those layers hold (each swapped layer's `dequantize()` copied into the float model, which
    runs eagerly: the head's new weight is a new tensor); then the speed model's decode at batch 1 and
    32 (the first context) against the floor of the bytes a step reads (its buffers and parameters
    but the embedding table, the KV)."""
    if (skip := skipped_without_cuda(run)) is not None:
        return skip
    from llmserve import LLM, SamplingParams
    from llmserve.model_loader import load_tokenizer
    from llmserve.quantization.kernels import QuantizedLinear

    plan = run.plan
    folder = greedy_folder(run)
    prompts = corpus_prompts(load_tokenizer(str(folder)), plan.greedy_lengths)
    params = SamplingParams(temperature=0, max_tokens=plan.greedy_new_tokens)
    engine = dict(device=plan.device, dtype="float32", **plan.engine_kwargs)
    with exact_float32():
        llm = LLM(str(folder), quantization=QUANTIZED_METHOD, **engine)
        layers = {
            n: m for n, m in llm.engine.model_runner.model.named_modules() if isinstance(m, QuantizedLinear)
        }
        kernels = sorted({type(layer.kernel).__name__ for layer in layers.values()})
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        weights = {name: layer.kernel.dequantize(torch.float32) for name, layer in layers.items()}
        llm.shutdown()
        del llm, layers
        free_memory()
        reference = LLM(str(folder), enforce_eager=True, **engine)
        modules = dict(reference.engine.model_runner.model.named_modules())
        with torch.no_grad():
            for name, weight in weights.items():
                if name == "lm_head":  # tied: the embedding keeps its float table
                    modules[name].weight = torch.nn.Parameter(weight)
                else:
                    modules[name].weight.copy_(weight)
        theirs = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
        reference.shutdown()
        del reference, modules, weights
        free_memory()
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if list(a) != list(b)]
    result: dict = {
        "method": QUANTIZED_METHOD,
        "device": plan.device,
        "kernels": kernels,
        "prompts": len(prompts),
        "equal": len(prompts) - len(differ),
        "differ": differ,
    }
    say(
        f"  {QUANTIZED_METHOD} on {kernels}: greedy equal to its float weights' for "
        f"{result['equal']}/{len(prompts)}"
    )
    speed, _, _ = speed_folder(run)
    llm, result["startup"] = start_engine(run, speed, {"quantization": QUANTIZED_METHOD})
    model = llm.engine.model_runner.model
    # what a step reads: every layer's codes and scales once; of the embedding table only its rows
    table = {id(t) for t in model.model.embed_tokens.parameters()}
    held = (t for t in (*model.parameters(), *model.buffers()) if id(t) not in table)
    weight_bytes = sum(t.numel() * t.element_size() for t in held)
    result["decode"] = []
    context = plan.decode_contexts[0]
    for batch in (1, 32 if run.cuda else plan.decode_batches[-1]):
        if run.seconds_left() < 45 and run.cuda:
            result["decode"].append({"batch": batch, "context": context, "status": "skipped: time budget"})
            continue
        ids = decoding(llm.engine, batch, context, seed=batch + 7, max_model_len=plan.max_model_len)
        times = time_decode(llm.engine, plan.decode_steps)
        finish(llm.engine, ids)
        result["decode"].append(decode_row(llm.engine, batch, context, times, weight_bytes))
        say(f"  {QUANTIZED_METHOD} decode {result['decode'][-1]}")
    llm.shutdown()
    return result


# -- the summary ---------------------------------------------------------------------------------------


def summary_rows(results: dict) -> list[dict]:
    """One row per figure: measured, its floor or ceiling, their ratio, the issue's target, verdict."""
    env = results.get("env", {})
    bandwidth = env.get("copy_gb_s")
    flops = env.get("matmul_tflop_s")
    rows = [
        _row("copy bandwidth GB/s", bandwidth),
        _row("bf16 matmul TFLOP/s", flops),
        *_test_rows(results.get("tests", {})),
        *_greedy_rows(results.get("greedy", {})),
        *_lora_rows(results.get("lora", {})),
    ]
    speed = results.get("speed", {})
    rows += _decode_rows(speed.get("decode", []), bandwidth)
    rows += _prefill_rows(speed.get("prefill"), flops)
    rows += _count_rows(speed.get("counts"))
    rows += _startup_rows(speed)
    rows += _quantized_rows(results.get("quantized", {}), bandwidth)
    return rows


def _row(name, measured, floor=None, ratio=None, target=None, ok=None) -> dict:
    return {"check": name, "measured": measured, "floor": floor, "ratio": ratio, "target": target, "ok": ok}


def _test_rows(tests: dict) -> list[dict]:
    if "passed" not in tests:
        return [_row("kernel tests (CUDA)", tests.get("status"))]
    measured = f"{tests['passed']} passed, {tests['failed'] + tests['error']} failed"
    bf16 = f"{tests['bf16_passed']} passed, {tests['bf16_failed']} failed"
    ok = tests["failed"] + tests["error"] == 0 and tests["passed"] > 0 and tests["returncode"] == 0
    return [
        _row("kernel tests (CUDA)", measured, target="all pass", ok=ok),
        _row("  of which bfloat16", bf16),
    ]


def _greedy_rows(greedy: dict) -> list[dict]:
    if "equal" not in greedy:
        return [_row("greedy = transformers (fp32)", greedy.get("status"))]
    measured = f"{greedy['equal']}/{greedy['prompts']} prompts"
    return [
        _row("greedy = transformers (fp32)", measured, target="all", ok=greedy["equal"] == greedy["prompts"])
    ]


def _lora_rows(lora: dict) -> list[dict]:
    if "equal" not in lora:
        return [_row("LoRA greedy = merged weights (fp32)", lora.get("status"))]
    measured = f"{lora['equal']}/{lora['prompts']} prompts"
    return [
        _row(
            "LoRA greedy = merged weights (fp32)", measured, target="all", ok=lora["equal"] == lora["prompts"]
        )
    ]


def _decode_rows(decode: list[dict], bandwidth: float | None) -> list[dict]:
    rows = []
    for entry in decode:
        name = f"decode b{entry['batch']} ctx{entry['context']} ms/step"
        if "step_ms" not in entry:
            rows.append(_row(name, entry.get("status")))
            continue
        floor = entry["bytes_per_step"] / (bandwidth * 1e9) * 1e3 if bandwidth else None
        ratio = entry["step_ms"] / floor if floor else None
        target = ok = None
        if entry["batch"] == 1:
            target = f"<= {TARGET_B1_FLOOR_RATIO}x floor"
            ok = None if ratio is None else ratio <= TARGET_B1_FLOOR_RATIO
        elif entry["batch"] >= 128:
            target = f">= {TARGET_B128_BANDWIDTH:.0%} of bandwidth (1/ratio)"
            ok = None if ratio is None else 1 / ratio >= TARGET_B128_BANDWIDTH
        rows.append(_row(name, entry["step_ms"], floor, ratio, target, ok))
    return rows


def _quantized_rows(quantized: dict, bandwidth: float | None) -> list[dict]:
    name = f"{QUANTIZED_METHOD} greedy = its float weights (fp32)"
    if "equal" not in quantized:
        return [_row(name, quantized.get("status"))]
    rows = [
        _row(
            f"{QUANTIZED_METHOD} layers' kernel",
            ", ".join(quantized["kernels"]),
            target="TritonKernel",
            ok=quantized["kernels"] == ["TritonKernel"] if quantized["device"] == "cuda" else None,
        ),
        _row(
            name,
            f"{quantized['equal']}/{quantized['prompts']} prompts",
            target="all",
            ok=quantized["equal"] == quantized["prompts"],
        ),
    ]
    for entry in quantized.get("decode", []):
        if "step_ms" not in entry:
            rows.append(_row(f"{QUANTIZED_METHOD} decode b{entry['batch']}", entry.get("status")))
            continue
        floor = entry["bytes_per_step"] / (bandwidth * 1e9) * 1e3 if bandwidth else None
        ratio = entry["step_ms"] / floor if floor else None
        rows.append(
            _row(
                f"{QUANTIZED_METHOD} decode b{entry['batch']} ctx{entry['context']} ms/step",
                entry["step_ms"],
                floor,
                ratio,
            )
        )
    return rows


def _prefill_rows(prefill: dict | None, flops: float | None) -> list[dict]:
    if not prefill:
        return []
    achieved = prefill["flop_per_s"] / 1e12
    fraction = achieved / flops if flops else None
    target = f">= {TARGET_PREFILL_FLOPS:.0%} of matmul"
    ok = None if fraction is None else fraction >= TARGET_PREFILL_FLOPS
    return [
        _row(f"prefill {prefill['prompt_len']}-token prompts tok/s", prefill["tokens_per_s"]),
        _row("  prefill TFLOP/s (ratio: of the matmul's)", achieved, flops, fraction, target, ok),
    ]


def _count_rows(counts: dict | None) -> list[dict]:
    if not counts:
        return []
    syncs = counts.get("sync_warnings_per_step", counts.get("host_syncs"))
    ok = None if syncs is None else syncs <= TARGET_SYNCS_PER_STEP
    return [
        _row(f"kernels per decode step (b{counts['batch']})", counts.get("kernel")),
        _row("host launch calls per decode step", counts.get("host_launches")),
        _row("host syncs per decode step", syncs, target=f"<= {TARGET_SYNCS_PER_STEP:.0f}", ok=ok),
    ]


def _startup_rows(speed: dict) -> list[dict]:
    startup = speed.get("startup")
    if not startup:
        return []
    rows = [_row("start-up to first token s", startup["first_token_s"])]
    eager = speed.get("eager", {})
    if "startup" not in eager:
        return [*rows, _row("  graphs' start-up over eager s", eager.get("status"))]
    extra = startup["first_token_s"] - eager["startup"]["first_token_s"]
    on_cuda = speed.get("engine", {}).get("device", "").startswith("cuda")  # graphs only there
    ok = extra <= TARGET_GRAPH_START_SECONDS if on_cuda else None
    target = f"<= {TARGET_GRAPH_START_SECONDS:.0f} s (an upper bound: cold first)"
    return [*rows, _row("  graphs' start-up over eager s", extra, target=target, ok=ok)]


def format_table(rows: list[dict]) -> str:
    header = ("check", "measured", "floor/ceil", "ratio", "target", "ok")
    cells = [header] + [
        (
            r["check"],
            _cell(r["measured"]),
            _cell(r["floor"]),
            _cell(r["ratio"]),
            r["target"] or "",
            {True: "PASS", False: "FAIL", None: ""}[r["ok"]],
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


# -- main ----------------------------------------------------------------------------------------------

SECTIONS: dict[str, Callable[[Run], dict]] = {
    "env": section_env,
    "tests": section_tests,
    "greedy": section_greedy,
    "lora": section_lora,
    "speed": section_speed,
    "quantized": section_quantized,
}


def run_section(run: Run, name: str) -> None:
    """One section in its own try: its figures, or its traceback's tail; saved at once."""
    say(f"== {name}")
    start = time.monotonic()
    try:
        result = SECTIONS[name](run)
    except Exception:  # noqa: BLE001 - one section's failure must not lose the others
        tail = traceback.format_exc().splitlines()[-15:]
        say("\n".join("  " + line for line in tail))
        result = {"status": "failed", "error": tail}
    result.setdefault("status", "ok")
    result["seconds"] = round(time.monotonic() - start, 1)
    free_memory()
    if torch.cuda.is_available():  # what the section's engines left behind, if anything
        result["allocated_after_gib"] = torch.cuda.memory_allocated() / 2**30
    say(f"  {name}: {result['status']} in {result['seconds']} s")
    run.results[name] = result
    run.save()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for cuda_check.json and tests.log")
    parser.add_argument("--bundle", type=Path, default=REPO / ".devbundle", help="the tokenizer folder")
    parser.add_argument("--write-bundle", type=Path, help="write the tokenizer folder here, then exit")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, in seconds")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_bundle is not None:
        files = write_bundle(args.write_bundle)
        size = sum((args.write_bundle / name).stat().st_size for name in files)
        say(f"{args.write_bundle}: {', '.join(files)} ({size / 2**20:.1f} MiB)")
        return 0
    if args.out is None:
        raise SystemExit("cuda_check: --out DIR is needed (or --write-bundle DIR)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cuda-check-") as work:
        bundle = args.bundle
        if args.smoke or not bundle.is_dir():  # from the embedded model, where it is installed
            bundle = Path(work) / "bundle"
            try:
                write_bundle(bundle)
            except Exception as error:  # noqa: BLE001 - the sections that need it fail, the rest run
                say(f"no tokenizer bundle at {args.bundle}, and none could be written: {error}")
        run = Run(SMOKE if args.smoke else FULL, args.out, bundle, Path(work))
        for name in args.sections:
            run_section(run, name)
    run.results["summary"] = summary_rows(run.results)
    run.save()
    say("== summary\n" + format_table(run.results["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
