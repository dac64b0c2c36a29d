"""Pooling (embedding) requests in the engine: the last token's final hidden state, L2-normalized, as
transformers computes it in float32, in one step or in chunks, batched with generation (which it does
not change); the request frees its KV blocks as soon as its prompt is computed."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers import make_tiny_llama_dir

PROMPT = list(range(200, 241))
OTHER = list(range(300, 320))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="module")
def expected(model_dir) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPT])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


def engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineArgs(model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB", **kwargs)
    )


def drain(llm: LLMEngine) -> dict[str, object]:
    finals = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-step", "chunked"])
def test_pooled_vector_matches_transformers_and_frees_its_blocks(model_dir, expected, budget):
    llm = engine(model_dir, max_num_batched_tokens=budget)
    llm.add_pooling_request("e", PROMPT)
    (output,) = drain(llm).values()
    assert output.outputs == [] and output.finished
    vector = torch.tensor(output.embedding)
    assert torch.nn.functional.cosine_similarity(vector, expected, dim=0) >= 0.9999
    torch.testing.assert_close(vector.norm(), torch.tensor(1.0))
    kv = llm.kv_cache_manager
    assert kv.usage == 0.0 and not llm.scheduler.num_running and not llm.scheduler.num_waiting


def test_pooling_batched_with_generation_changes_neither(model_dir, expected):
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    alone = engine(model_dir)
    alone.add_request("g", OTHER, params)
    generated = drain(alone)["g"].outputs[0].token_ids
    mixed = engine(model_dir)
    mixed.add_request("g", OTHER, params)
    mixed.add_pooling_request("e", PROMPT)
    finals = drain(mixed)
    assert finals["g"].outputs[0].token_ids == generated
    vector = torch.tensor(finals["e"].embedding)
    assert torch.nn.functional.cosine_similarity(vector, expected, dim=0) >= 0.9999
