"""The fused decode stack (one compiled call for all decoder layers) against the module path."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.model_loader import default_model_path, load_tokenizer
from tests.helpers import TINY_LLAMA_CONFIG, make_tiny_llama_dir

ops = load_cpu_ops()
HAS_BF16 = ops is not None and ops.small_batch_linear_supported()
pytestmark = pytest.mark.cpu_kernels("avx2")  # the float32 kernel; every AVX-512 BF16 CPU has AVX2 too
needs_bf16 = pytest.mark.cpu_kernels("bf16_linear")
DTYPE = "bfloat16" if HAS_BF16 else "float32"  # for the tests that hold for either

PROMPTS = [[5, 6, 7, 8] * 6, list(range(1000, 1030)), [31, 4159, 2653], [100, 200, 300] * 5 + [9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # head_dim 64 takes the attention kernel's bf16 fast path, as SmolLM2 does
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny")), hidden_size=128, num_attention_heads=2)


class _Counting:
    def __init__(self, stack) -> None:
        self.stack, self.calls, self.max_rows_seen, self.rows_seen = stack, 0, 0, set()
        self.small_calls = 0  # calls of at most 8 rows (the small-batch kernels' limit)

    def serves(self, *args) -> bool:
        return self.stack.serves(*args)

    def __call__(self, hidden, *args):
        self.calls += 1
        self.small_calls += hidden.shape[0] <= 8
        self.max_rows_seen = max(self.max_rows_seen, hidden.shape[0])
        self.rows_seen.add(hidden.shape[0])
        return self.stack(hidden, *args)


def _run(llm: LLM, prompts, max_tokens: int = 20):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize(
    ("dtype", "speculative_method", "quantization"),
    [
        pytest.param("bfloat16", None, None, marks=needs_bf16),
        pytest.param("bfloat16", "ngram", None, marks=needs_bf16),
        pytest.param("bfloat16", None, "int8-rtn", marks=needs_bf16),
        pytest.param("bfloat16", "ngram", "int4", marks=needs_bf16),
        ("float32", None, None),
        ("float32", "ngram", None),
        ("float32", None, "int8-rtn"),
        ("float32", "ngram", "int4"),
    ],
)
def test_bit_identical_to_the_module_path(model_dir, dtype, speculative_method, quantization):
    """Same tokens and the very same log-probabilities with and without the stack, for a batch of
    decodes, for speculative verification spans (k + 1 rows per sequence), with int8 and int4
    weights and in float32 (quantized float32 layers join the stack where their small-batch kernels
    take float32 inputs, the AVX2 level; elsewhere they dequantize and the model runs its modules)."""
    llm = LLM(
        model_dir,
        dtype=dtype,
        kv_cache_memory="8MiB",
        max_model_len=256,
        prefix_caching=False,
        speculative_method=speculative_method,
        speculative_disable_batch_size=0,
        quantization=quantization,
    )
    runner = llm.engine.model_runner
    stack = runner.decode_stack
    if dtype == "float32" and quantization and not ops.small_batch_linear_int8_supported(torch.float32):
        assert stack is None
        return
    assert stack is not None
    runner.decode_stack = counting = _Counting(stack)
    fused = _run(llm, PROMPTS[:3]) + _run(llm, PROMPTS[3:])
    assert counting.calls >= 20  # the decode steps of both batches went through it
    # int8/int4 or bf16 layers: every step of at most 8 rows held the threads in one region (where
    # there are threads); float32 ones keep the op-by-op stack
    expected = counting.small_calls if _in_region(dtype, quantization) else 0
    assert stack.one_region_calls == expected, counting.rows_seen
    runner.decode_stack = None
    assert _run(llm, PROMPTS[:3]) + _run(llm, PROMPTS[3:]) == fused


def _threads() -> int:
    return torch.get_num_threads()


def _in_region(dtype: str, quantization: str | None) -> bool:
    """Whether the stack's steps of at most 8 rows run in one parallel region: int8/int4 or bf16
    projections, and threads to hold."""
    return (quantization is not None or dtype == "bfloat16") and _threads() > 1


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    """A tiny Qwen2: a q/k/v bias (non-zero, drawn large), which above 8 rows goes into oneDNN's GEMM
    (fused there, not added after: different bits) as the module path does."""
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    torch.manual_seed(1)
    config = transformers.Qwen2Config(**{**TINY_LLAMA_CONFIG, "hidden_size": 128, "num_attention_heads": 2})
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
            elif "bias" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    """A tiny Qwen3: an RMSNorm over each query and key head before rope, its weights drawn away
    from 1 so that a stack skipping or misplacing them would give other tokens."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    torch.manual_seed(2)
    config = transformers.Qwen3Config(
        **{**TINY_LLAMA_CONFIG, "hidden_size": 128, "num_attention_heads": 2, "head_dim": 64}
    )
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
            elif "q_norm" in name or "k_norm" in name:
                param.uniform_(0.5, 2.0)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        pytest.param("bfloat16", None, marks=needs_bf16),
        pytest.param("bfloat16", "int4", marks=needs_bf16),
        ("float32", None),
    ],
)
def test_qwen3_head_norms_run_in_the_stack(qwen3_dir, dtype, quantization):
    """Qwen3's per-head query and key norms run inside the stack, between the qkv projection and
    rope, as QKNormAttention runs them: the same tokens and log-probabilities with and without it."""
    stack = _assert_three_decodes_bit_identical(qwen3_dir, dtype=dtype, quantization=quantization)
    assert (stack.one_region_calls > 0) == _in_region(dtype, quantization)


@needs_bf16
def test_qkv_bias_in_one_region(qwen2_dir):
    """Qwen2's q/k/v bias added after the int4 projection, in the region that holds the threads for the
    whole step, as the module path adds it."""
    stack = _assert_three_decodes_bit_identical(qwen2_dir, dtype="bfloat16", quantization="int4")
    assert (stack.one_region_calls > 0) == (_threads() > 1)


@needs_bf16
def test_qkv_bias_then_adapters_in_one_region(qwen2_dir, tmp_path, monkeypatch):
    """Qwen2's q/k/v bias, then an adapter's delta, in the modules' order (the bias inside the projection,
    the delta after it), in the one region: the same tokens and log-probs as the modules."""
    from benchmarks.tools.lora_adapters import write_adapter
    from llmserve.model_loader import load_arch_config

    adapter = write_adapter(tmp_path / "adapter", load_arch_config(qwen2_dir), 8, seed=0)
    llm = LLM(
        qwen2_dir,
        dtype="bfloat16",
        kv_cache_memory="8MiB",
        max_model_len=256,
        prefix_caching=False,
        quantization="int4",
        enable_lora=True,
        lora_modules=[f"a={adapter}"],
        max_loras=1,
        max_lora_rank=8,
    )
    stack = llm.engine.model_runner.decode_stack
    assert stack is not None and stack.lora_bound
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, lora_name="a")

    def run():
        outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    fused = run()
    assert (stack.one_region_calls > 0) == (_threads() > 1)
    monkeypatch.setattr(stack, "lora_bound", False)
    monkeypatch.setattr(stack, "max_rows", 0)  # every step on the modules
    assert run() == fused


@pytest.fixture
def three_threads():
    """torch's threads at 3 for the test (more than this CI's cores: the region's uneven splits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("quantization", ["int4", "int8-rtn", pytest.param(None, marks=needs_bf16)])
def test_one_region_with_three_threads(model_dir, three_threads, quantization):
    """Three threads split 32-row blocks, attention items and output rows unevenly (a thread with one
    block fewer, a KV head's query rows over three parts): the module path's bits all the same, with
    int4, int8 and bf16 projections."""
    if quantization and not ops.small_batch_linear_int8_supported(getattr(torch, DTYPE)):
        pytest.skip("float32 int8/int4 layers need the AVX2 level's kernels (this CPU has AVX-512 VNNI's)")
    stack = _assert_three_decodes_bit_identical(model_dir, dtype=DTYPE, quantization=quantization)
    assert stack.one_region_calls >= 19


def _assert_three_decodes_bit_identical(path: str, **engine_args):
    """The model at `path` has a stack, and three decodes give the very same tokens and
    log-probabilities through it as through the modules; returns the stack."""
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=256, prefix_caching=False, **engine_args)
    runner = llm.engine.model_runner
    stack = runner.decode_stack
    assert stack is not None
    runner.decode_stack = counting = _Counting(stack)
    fused = _run(llm, PROMPTS[:3])
    assert counting.calls >= 19
    runner.decode_stack = None
    assert _run(llm, PROMPTS[:3]) == fused
    return stack


@pytest.fixture
def without_amx(monkeypatch):
    """Models built as on an AVX-512 BF16 CPU without AMX: rows above 8 go to the small-batch kernel up
    to KERNEL_MAX_ROWS, oneDNN's GEMM above."""
    import llmserve.kernels.small_batch_linear as small_batch_linear

    class NoAmx:
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def amx_linear_supported() -> bool:
            return False

    monkeypatch.setattr(small_batch_linear, "load_cpu_ops", NoAmx)


@pytest.fixture
def onednn_above_8(without_amx, monkeypatch):
    """As without AMX, with oneDNN's GEMM from 9 rows (where the kernel's limit is set to 8)."""
    import llmserve.kernels.small_batch_linear as small_batch_linear

    monkeypatch.setattr(small_batch_linear, "KERNEL_MAX_ROWS", small_batch_linear.MAX_ROWS)


@needs_bf16
@pytest.mark.parametrize("path_above_8", ["amx-where-present", "without_amx", "onednn_above_8"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_batches_above_the_small_batch_kernel_bit_identical(
    model_dir, qwen2_dir, qwen3_dir, architecture, path_above_8, request
):
    """Above 8 rows the stack runs AMX, the small-batch kernel in tiles of 8 rows (no AMX) or oneDNN's
    GEMM (rows padded as the modules pad them) on the layers' copies, as the modules do: a batch of 19
    decodes (rows 19 down to 1 as they finish at different lengths) gives the very same tokens and
    log-probabilities with the stack and without it, with and without a q/k/v bias."""
    amx = path_above_8 == "amx-where-present"
    if not amx:
        request.getfixturevalue(path_above_8)
    path = {"llama": model_dir, "qwen2": qwen2_dir, "qwen3": qwen3_dir}[architecture]
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256, prefix_caching=False)
    runner, inner = llm.engine.model_runner, llm.engine.model_runner.model.model
    # the stack takes more than 8 rows where the kernel takes every row count, or every layer has its
    # oneDNN copy for the rows above the kernel's (oneDNN packs no bf16 weight with its ISA capped at
    # AVX2): else the modules take them
    qkv = inner.layers[0].self_attn.qkv_proj
    packs = qkv.kernel_max_rows == sys.maxsize or qkv.packed_weight is not None
    assert (runner.decode_stack.max_rows > 8) == packs
    assert (inner.layers[0].self_attn.qkv_proj.bias is not None) == (architecture == "qwen2")
    assert amx or not inner.layers[0].self_attn.qkv_proj.amx
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(19)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=3) for i in range(19)
    ]

    def run():
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    runner.decode_stack = counting = _Counting(runner.decode_stack)
    fused = run()
    assert counting.max_rows_seen == (19 if packs else 8) and counting.calls >= (30 if packs else 8)
    runner.decode_stack = None
    assert run() == fused


def _decode_17_with_onednn_verbose(model_dir, capfd) -> tuple[_Counting, list[str]]:
    """17 decodes after their prefill, the stack counted: the rows it saw and oneDNN's exec lines."""
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256, prefix_caching=False)
    runner = llm.engine.model_runner
    prompts = [[(5 * i + j) % 400 + 3 for j in range(12)] for i in range(17)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # prefill first: its rows are the modules'
    runner.decode_stack = counting = _Counting(runner.decode_stack)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        llm.generate(prompts, params, use_tqdm=False)
    lines = capfd.readouterr().out.splitlines()
    return counting, [line for line in lines if "onednn_verbose" in line and ",exec," in line]


@needs_bf16
@pytest.mark.cpu_kernels("onednn_bf16")
def test_onednn_in_the_stack_runs_the_padded_row_counts(model_dir, onednn_above_8, capfd):
    """oneDNN builds and caches a primitive per row count: the stack hands it the modules' rounded
    counts (17 decodes run as 18 rows), so a server's varied batches do not fill its cache."""
    counting, lines = _decode_17_with_onednn_verbose(model_dir, capfd)
    assert 17 in counting.rows_seen  # the decode steps
    assert any("mb18ic" in line for line in lines)
    assert not any("mb17ic" in line for line in lines)


@needs_bf16
@pytest.mark.cpu_kernels("onednn_bf16")
def test_without_amx_decode_batches_run_the_kernel_not_onednn(model_dir, without_amx, capfd):
    """Without AMX the stack and the modules run up to KERNEL_MAX_ROWS rows on the small-batch
    kernel, faster than oneDNN's GEMM there (kernels/small_batch_linear.py): no GEMM for 17 decodes."""
    counting, lines = _decode_17_with_onednn_verbose(model_dir, capfd)
    assert 17 in counting.rows_seen
    assert not any("mb17ic" in line or "mb18ic" in line for line in lines)


def test_rebound_caches_take_the_module_path(model_dir):
    """The naive-batching baseline points the attention layers at a buffer of its own: the stack,
    built on the engine's pool, must then step aside, and its tokens equal the engine's."""
    from llmserve.benchmarks.naive_batching import NaiveBatchRunner

    llm = LLM(model_dir, dtype=DTYPE, kv_cache_memory="8MiB", max_model_len=256, prefix_caching=False)
    runner = llm.engine.model_runner
    runner.decode_stack = counting = _Counting(runner.decode_stack)
    engine_tokens = [tokens for tokens, _ in _run(llm, PROMPTS[:2], max_tokens=12)]
    engine_calls = counting.calls
    assert engine_calls > 0
    naive = NaiveBatchRunner(llm.engine.model_runner.model, llm.engine.config.cache.block_size)
    tokens, _ = naive.generate(PROMPTS[:2], [12, 12], batch_size=2)
    assert tokens == engine_tokens
    assert counting.calls == engine_calls  # every naive decode step took the module path


@needs_bf16
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "float32"])
def test_quantized_layers_take_every_decode_batch_into_the_stack(model_dir, dtype):
    """int8 and int4 layers run their compiled kernels at any row count: decode batches above 8 rows
    go through the stack too, bit-identical to the module path (float32 where the kernels take
    float32 inputs, the AVX2 level; elsewhere those layers dequantize and there is no stack)."""
    llm = LLM(
        model_dir,
        dtype=dtype,
        kv_cache_memory="8MiB",
        max_model_len=256,
        prefix_caching=False,
        quantization="int4",
    )
    runner = llm.engine.model_runner
    if dtype == "float32" and not ops.small_batch_linear_int8_supported(torch.float32):
        assert runner.decode_stack is None
        return
    assert runner.decode_stack.max_rows == float("inf")
    prompts = [[7 * i + j + 3 for j in range(5)] for i in range(12)]
    runner.decode_stack = counting = _Counting(runner.decode_stack)
    fused = _run(llm, prompts, max_tokens=6)
    assert counting.max_rows_seen > 8
    runner.decode_stack = None
    assert _run(llm, prompts, max_tokens=6) == fused


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "float32"])
@pytest.mark.parametrize("quantization", [None, "int8-rtn"])
def test_8_bit_kv_caches_run_in_the_stack(model_dir, dtype, kv_cache_dtype, quantization):
    """Over an int8 or fp8 cache the stack quantizes each new K/V row as the cache format does (the
    same ops: codes against the float16-rounded scale) and attends over the codes: the very same
    tokens and log-probabilities with and without it (int8 layers: in one parallel region)."""
    if dtype == "float32" and quantization and not ops.small_batch_linear_int8_supported(torch.float32):
        pytest.skip("float32 int8 layers need the AVX2 level's kernels (this CPU has AVX-512 VNNI's)")
    stack = _assert_three_decodes_bit_identical(
        model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization
    )
    assert (stack.one_region_calls > 0) == _in_region(dtype, quantization)


def test_a_failure_inside_the_region_is_raised(model_dir):
    """A kernel that fails on one of the region's threads (here a cache slot out of range) ends the
    region on every thread and is raised to the caller, not left to terminate the process."""
    llm = LLM(model_dir, dtype=DTYPE, kv_cache_memory="8MiB", max_model_len=256, quantization="int4")
    stack = llm.engine.model_runner.decode_stack
    if stack is None:
        pytest.skip("float32 int4 layers need the AVX2 level's kernels (this CPU has AVX-512 VNNI's)")
    if _threads() < 2:
        pytest.skip("one thread: the stack holds no region")
    with pytest.raises(RuntimeError, match="slot out of range"):
        stack.stack.forward(
            stack.embed_tokens(torch.tensor([5])),
            torch.tensor([0], dtype=torch.int64),
            torch.tensor([1 << 40], dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.tensor([1], dtype=torch.int64),
            torch.tensor([0, 1], dtype=torch.int64),
            16,
            0,
            0,
        )
    assert stack.one_region_calls == 1
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4  # the engine still serves


def test_not_built_where_it_does_not_apply(model_dir):
    int4_kv = LLM(model_dir, dtype=DTYPE, kv_cache_memory="8MiB", max_model_len=256, kv_cache_dtype="int4")
    assert int4_kv.engine.model_runner.decode_stack is None
    torch_attention = LLM(
        model_dir, dtype=DTYPE, kv_cache_memory="8MiB", max_model_len=256, attention_backend="torch"
    )
    assert torch_attention.engine.model_runner.decode_stack is None


def test_hidden_state_hooks_see_the_steps_the_stack_runs(model_dir):
    """Evaluation reads each step's hidden states from the model runner: windows short enough for
    the stack (it runs no module hooks) are scored as the module path scores them."""
    from llmserve.evaluation.perplexity import evaluate_perplexity

    llm = LLM(model_dir, dtype=DTYPE, kv_cache_memory="8MiB", max_model_len=256, prefix_caching=False)
    runner = llm.engine.model_runner
    token_ids = [(11 * i) % 700 + 3 for i in range(40)]
    runner.decode_stack = counting = _Counting(runner.decode_stack)
    fused = evaluate_perplexity(llm.engine, token_ids, context=8, decode_tokens=0)
    assert counting.calls >= 5 and fused.nll > 0  # the windows went through the stack and were scored
    runner.decode_stack = None
    plain = evaluate_perplexity(llm.engine, token_ids, context=8, decode_tokens=0)
    assert fused.tokens == plain.tokens and fused.nll == pytest.approx(plain.nll, rel=1e-5)


MOE_CASES = {  # widths whose experts take groups of 32; Qwen3-MoE's layer 1 dense, weights not renormalized
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {"num_local_experts": 4}),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {"num_experts": 8, "moe_intermediate_size": 64, "mlp_only_layers": [1], "norm_topk_prob": False},
    ),
}


@pytest.fixture(scope="module", params=list(MOE_CASES))
def moe_dir(request, tmp_path_factory) -> tuple[str, str]:
    """A tiny random Mixtral or Qwen3-MoE (3 layers, top 2), weights drawn large: peaked routing."""
    config_cls, model_cls, extra = MOE_CASES[request.param]
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    torch.manual_seed(3)
    config = config_cls(
        **{**TINY_LLAMA_CONFIG, "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 3},
        num_experts_per_tok=2,
        **extra,
    )
    model = model_cls(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
            else:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)
    return request.param, path


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        pytest.param("bfloat16", "int4", marks=needs_bf16),
        pytest.param("bfloat16", "int8-rtn", marks=needs_bf16),
        ("float32", "int4"),
    ],
)
def test_quantized_expert_layers_run_in_the_stack(moe_dir, dtype, quantization):
    """Mixtral's and Qwen3-MoE's int8/int4 expert layers (and Qwen3-MoE's dense one) run inside the
    stack: the router as a linear layer, softmax, top k (renormalized or not) and one `moe_experts`
    call, as the modules run them: the very same tokens and log-probabilities with and without it,
    for decodes of three sequences and of 12 (above 8 rows the router takes what its module takes:
    AMX, the kernel's tiles or oneDNN; the grouped experts any row count). Float experts, or float32
    activations where the level's int8/int4 kernels take none, leave the model on its modules."""
    _, path = moe_dir
    llm = LLM(
        path,
        dtype=dtype,
        kv_cache_memory="8MiB",
        max_model_len=256,
        prefix_caching=False,
        quantization=quantization,
        quantization_group_size=32,
    )
    runner = llm.engine.model_runner
    if dtype == "float32" and not ops.small_batch_linear_int8_supported(torch.float32):
        assert runner.decode_stack is None
        return
    stack = runner.decode_stack
    assert stack is not None and stack.has_experts
    many = [[(7 * i + j) % 500 + 3 for j in range(5 + 2 * i)] for i in range(12)]
    runner.decode_stack = counting = _Counting(stack)
    fused = _run(llm, PROMPTS[:3]), _run(llm, many, max_tokens=6)
    # a stack held to 8 rows (a float32 router: its oneDNN copy is not kept) leaves the 12 to the modules
    assert counting.calls >= 19 and counting.max_rows_seen == (12 if stack.max_rows > 8 else 3)
    runner.decode_stack = None
    assert (_run(llm, PROMPTS[:3]), _run(llm, many, max_tokens=6)) == fused
    assert stack.one_region_calls == 0  # expert layers keep the op-by-op stack
    llm.shutdown()
    floats = LLM(path, dtype=dtype, kv_cache_memory="8MiB", max_model_len=256)
    assert floats.engine.model_runner.decode_stack is None  # torch's grouped matmul: the modules
