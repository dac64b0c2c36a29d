"""An untied GGUF embedding kept in its blocks (`quantization/embedding.embed_from_blocks`): a Q4_K_M of
an untied model (Llama 3, Mistral) holds `token_embd` as Q4_K beside a Q6_K `output`. Its rows are read
from the blocks on lookup, equal to the file's dequantized rows in the model's dtype, and no float table
is ever allocated."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from llmserve import LLM, SamplingParams
from llmserve.benchmarks.latency import model_size
from llmserve.config import EngineArgs
from llmserve.distributed.group import TensorParallelGroup
from llmserve.model_loader import load_arch_config
from llmserve.quantization.embedding import HeadRowsEmbedding
from llmserve.quantization.kernels import QuantizedLinear, RoundedInputKernel
from llmserve.worker.model_loading import load_model
from tests.quantization.moe_reference import assert_greedy_equal_but_at_near_ties, dequantized_reference
from tests.quantization.test_gguf_mixed_shards import ENGINE, HIDDEN, VOCAB, write_q4_k_m


@pytest.fixture(scope="module")
def untied_gguf(tmp_path_factory) -> str:
    return write_q4_k_m(str(tmp_path_factory.mktemp("untied") / "q4_k_m.gguf"), untied=True)


def _file_embedding(path: str) -> torch.Tensor:
    (tensor,) = [t for t in GGUFReader(path).tensors if t.name == "token_embd.weight"]
    assert tensor.tensor_type == GGMLQuantizationType.Q4_K
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(VOCAB, HIDDEN))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_embedding_reads_the_files_rows_from_its_blocks(untied_gguf, dtype, tmp_path, monkeypatch):
    """The embedding owns its blocks' packed copy (Q4_K: 4.6 bits a weight, factored parameters where
    the compiled kernels hold it), no vocabulary-sized float tensor is left in the model, and every
    row equals the file's dequantized row in the model's dtype."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(untied_gguf, dtype=dtype, quantization="gguf", **ENGINE)
    model = llm.engine.model_runner.model
    embedding = model.model.embed_tokens
    assert isinstance(embedding, HeadRowsEmbedding) and embedding.blocks is not model.lm_head
    float_tables = [
        name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.is_floating_point() and tensor.numel() >= VOCAB * HIDDEN
    ]  # fmt: skip
    assert float_tables == []
    if isinstance(embedding.blocks.kernel, RoundedInputKernel):
        held = sum(b.numel() * b.element_size() for b in embedding.blocks.buffers())
        assert held * 8 / (VOCAB * HIDDEN) < 4.7
    ids = torch.arange(VOCAB).view(20, -1)
    expected = _file_embedding(untied_gguf).to(getattr(torch, dtype))
    assert torch.equal(embedding(ids), expected[ids])
    # a decode step reads a row of it: the latency floor leaves its blocks out, as an untied float table
    linears = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear))
    floats = sum(p.numel() for p in model.parameters())
    assert model_size(model)[0] == linears + floats - VOCAB * HIDDEN
    llm.shutdown()


def test_greedy_outputs_equal_the_float_tables(untied_gguf, tmp_path, monkeypatch):
    """Served from its blocks, the model answers as with the float table the loader would build (the
    path a kernel that cannot rebuild rows exactly takes): tokens and log-probabilities bit for bit."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    prompts = [{"prompt_token_ids": [1, 17, 400, 4100, 9]}, {"prompt_token_ids": [1, 2000, 33]}]

    def run() -> list:
        llm = LLM(untied_gguf, dtype="float32", quantization="gguf", **ENGINE)
        table = isinstance(llm.engine.model_runner.model.model.embed_tokens, torch.nn.Embedding)
        outputs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        llm.shutdown()
        return table, outputs

    table, blocks = run()
    assert not table
    monkeypatch.setattr(RoundedInputKernel, "weight_rows", lambda self, index: None)
    table, floats = run()
    assert table
    assert blocks == floats


def test_each_tensor_parallel_rank_holds_its_vocabulary_blocks_rows(untied_gguf, tmp_path, monkeypatch):
    """Under tensor parallelism each rank's embedding keeps the blocks of its vocabulary block (zero rows
    pad the last), read back as the file's rows; the float table is left out of every rank's load."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    engine = dict(dtype="float32", kv_cache_memory="4MiB", tensor_parallel_size=2, quantization="gguf")
    args = EngineArgs(model=untied_gguf, **engine)
    config = args.create_config(load_arch_config(untied_gguf), untied_gguf).model
    expected = _file_embedding(untied_gguf)
    for rank in range(2):
        model = load_model(config, group=TensorParallelGroup(rank, 2))
        embedding = model.model.embed_tokens
        assert isinstance(embedding, HeadRowsEmbedding)
        vocab = embedding.vocab
        assert 0 < len(vocab) < VOCAB and embedding.num_embeddings >= len(vocab)
        local = torch.arange(embedding.num_embeddings)
        rows = embedding.rows(local)
        assert torch.equal(rows[: len(vocab)], expected[vocab.start : vocab.stop])
        assert not rows[len(vocab) :].any()


def test_an_untied_q4_k_m_gives_the_float_runs_tokens(untied_gguf, tmp_path, monkeypatch):
    """The whole Q4_K_M-style file served in its blocks (Q4_K and Q6_K layers with factored scales
    where the compiled kernels hold them, the Q4_K embedding and Q6_K head in theirs) gives the greedy
    tokens of the same file served in float32 (`--quantization none`, inputs rounded where the kernels
    round theirs), parting only at a near tie."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    quantized = LLM(untied_gguf, quantization="gguf", dtype="float32", **ENGINE)
    reference = LLM(untied_gguf, quantization="none", dtype="float32", **ENGINE)
    try:
        kernels = [
            m.kernel
            for m in quantized.engine.model_runner.model.modules()
            if isinstance(m, QuantizedLinear) and isinstance(m.kernel, RoundedInputKernel)
        ]
        if kernels:  # the compiled kernels hold every layer here, its scales factored
            assert {k.small_batch_scales.dtype for k in kernels} == {torch.uint8, torch.int8}
        rounded = dequantized_reference(quantized, reference)
        if rounded:
            reference.engine.model_runner.decode_stack = None  # the rounding hooks are on the modules
        prompts = [[1, 17, 400, 4100, 9], [1, 2000, 33, 5, 6, 7], [1, 3]]
        assert_greedy_equal_but_at_near_ties(quantized, reference, prompts, rounded)
    finally:
        quantized.shutdown()
        reference.shutdown()
