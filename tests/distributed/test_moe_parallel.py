"""Mixture-of-experts models over two ranks, as real processes over gloo: tensor parallelism (every
expert's units split) and expert parallelism (the experts split; each rank computing its experts'
pairs of every token, or tokens dispatched by all-to-all) give transformers' greedy tokens in
float32, and rank 0 counts the expert load it computed.

Two requests of different lengths make the later decode steps a single token, fewer tokens than
ranks: under the all-to-all dispatch rank 1 then routes none and only receives.
"""

from __future__ import annotations

import gguf
import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.distributed.expert_parallel import total_expert_load
from llmserve.quantization.moe import QuantizedMoEExperts
from tests.distributed.conftest import assert_same_greedy
from tests.e2e.conftest import hf_greedy
from tests.helpers import wait_until
from tests.models.families import CASES, VOCAB, make_family_dir
from tests.models.moe_gguf import VOCAB as GGUF_VOCAB
from tests.models.moe_gguf import write_moe_gguf

pytestmark = pytest.mark.process

PROMPT_LENGTHS, MAX_TOKENS = (20, 7), (12, 4)


def _rank1_report(llm):
    def reported():
        report = llm.engine.rank_stats()[1]
        return report if report.num_steps else None

    return wait_until(reported, 30, "rank 1's report of a step")


@pytest.mark.parametrize(
    ("expert_parallel", "all2all_backend"),
    [(False, "naive"), (True, "naive"), (True, "all_to_all")],
    ids=["tp", "ep", "ep-all-to-all"],
)
@pytest.mark.parametrize("case", ["mixtral-top2-of-4", "qwen3-moe-dense-layer"])
def test_two_ranks_give_transformers_greedy_tokens(tmp_path, case, expert_parallel, all2all_backend):
    hf = make_family_dir(str(tmp_path), case)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory="8MiB",
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        all2all_backend=all2all_backend,
    )
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        first_expert, tokens, sent = total_expert_load(llm.engine.model_runner.model)
        rank1 = _rank1_report(llm)
    finally:
        llm.shutdown()
    for prompt, output, max_tokens in zip(prompts, outputs, MAX_TOKENS, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, max_tokens)
    num_experts = CASES[case][2]["num_local_experts" if case.startswith("mixtral") else "num_experts"]
    if expert_parallel:  # rank 0 holds the first half of the experts and sent rows (or sums) to rank 1
        assert first_expert == 0 and len(tokens) == num_experts // 2
        assert sum(tokens) > 0 and sent > 0
        # rank 1's report, up its start-up pipe: the other half
        assert rank1.first_expert == num_experts // 2 and len(rank1.expert_tokens) == num_experts // 2
    else:  # every rank routes every token to top-2 experts in every expert layer
        expert_layers = 3 - ("qwen3" in case)  # Qwen3-MoE's layer 1 is dense
        fed = sum(PROMPT_LENGTHS) + sum(MAX_TOKENS) - len(MAX_TOKENS)
        assert len(tokens) == num_experts and sent == 0
        assert sum(tokens) >= 2 * expert_layers * fed
        assert rank1.first_expert == 0 and len(rank1.expert_tokens) == num_experts


def test_expert_parallel_pipeline_stages_give_transformers_greedy_tokens(tmp_path):
    """TP=2 x PP=2 (four processes): each stage's two ranks split its expert layers' experts, their
    all-to-alls on the stage's own group."""
    hf = make_family_dir(str(tmp_path), "qwen3-moe-dense-layer")
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory="8MiB",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        enable_expert_parallel=True,
    )
    try:
        (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_int4_experts_split_over_ranks_give_one_process_tokens(tmp_path, monkeypatch, expert_parallel):
    """int4 quantizes each rank's own experts (or units): with one group size, the tokens of one
    process quantizing the whole model."""
    case = (  # widths whose per-rank shares take groups of 32
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128),
    )
    monkeypatch.setitem(CASES, "qwen3-moe-int4", case)
    make_family_dir(str(tmp_path), "qwen3-moe-int4")
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    outputs = []
    for parallel in (dict(), dict(tensor_parallel_size=2, enable_expert_parallel=expert_parallel)):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_model_len=128,
            kv_cache_memory="8MiB",
            quantization="int4",
            quantization_group_size=32,
            **parallel,
        )
        try:
            outputs += llm.generate([prompt], params, use_tqdm=False)
        finally:
            llm.shutdown()
    assert_same_greedy(*outputs)


@pytest.mark.parametrize(
    ("arch", "qtype", "expert_parallel"),
    [("qwen3moe", "Q4_0", False), ("llama", "Q8_0", True)],
    ids=["qwen3-moe-tp", "mixtral-ep"],
)
def test_gguf_experts_split_over_ranks_give_one_process_tokens(
    tmp_path, monkeypatch, arch, qtype, expert_parallel
):
    """`--quantization gguf` over two ranks cuts the file's expert blocks (every expert's units of
    Qwen3-MoE's 64, or Mixtral's experts whole): one process's greedy tokens and log-probabilities,
    rank 0 holding half of one process's expert bytes (test_moe_quantized_shards.py: both ranks,
    exactly)."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))  # the ranks inherit it
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_moe_gguf(path, arch, getattr(gguf.GGMLQuantizationType, qtype))
    prompt = torch.randint(3, GGUF_VOCAB, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    outputs, expert_bytes = [], []
    for parallel in (dict(), dict(tensor_parallel_size=2, enable_expert_parallel=expert_parallel)):
        llm = LLM(
            path, dtype="float32", max_model_len=128, kv_cache_memory="8MiB", quantization="gguf", **parallel
        )
        try:
            outputs += llm.generate([prompt], params, use_tqdm=False)
            modules = llm.engine.model_runner.model.modules()
            layers = [module for module in modules if isinstance(module, QuantizedMoEExperts)]
            expert_bytes.append(sum(b.numel() * b.element_size() for m in layers for b in m.buffers()))
        finally:
            llm.shutdown()
    assert_same_greedy(*outputs)
    one, split = (output.outputs[0] for output in outputs)
    for step, (a, b) in enumerate(zip(one.token_ids, split.token_ids, strict=True)):
        if a != b:
            break
        assert abs(one.logprobs[step][a] - split.logprobs[step][b]) < 1e-3, step
    assert expert_bytes[0] > 0 and expert_bytes[1] == expert_bytes[0] // 2
