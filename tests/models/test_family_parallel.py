"""Families split over processes give transformers' greedy tokens: tensor parallelism (heads, MLP and
vocabulary over 2 ranks) for the Llama-like families, pipeline parallelism (layers over 2 stages) for
Gemma and Mixtral, whose modules differ from Llama's."""

import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.e2e.conftest import hf_greedy

from .families import VOCAB, make_family_dir

pytestmark = pytest.mark.process


@pytest.mark.parametrize(
    "case, parallel",
    [
        ("qwen3-qk-norm", dict(tensor_parallel_size=2)),
        ("phi3-partial-rotary", dict(tensor_parallel_size=2)),
        ("gemma2-softcap-interleaved-window", dict(pipeline_parallel_size=3)),
        ("mixtral-top2-of-4", dict(pipeline_parallel_size=3)),
    ],
)
def test_split_model_greedy_equals_transformers(tmp_path, case, parallel):
    hf = make_family_dir(str(tmp_path), case)
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory="8MiB", **parallel)
    try:
        (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
