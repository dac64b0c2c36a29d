"""A tied embedding read from its quantized output projection (quantization/embedding.py): the rows
equal gguf-py's dequantization of the file's token_embd exactly, and a tied GGUF model under
`--quantization gguf` gives the float table's logits and tokens bit for bit, holding the table's
bytes less."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.distributed.group import single_rank
from llmserve.quantization import gguf_native, methods, sharding
from llmserve.quantization.embedding import HeadRowsEmbedding
from llmserve.quantization.formats import shard_rows
from llmserve.quantization.kernels import DequantizeKernel, QuantizedLinear, RoundedInputKernel
from llmserve.worker.memory_report import weights_memory_bytes
from tests.e2e.conftest import teacher_forced_logits
from tests.models.moe_gguf import _tokenizer
from tests.models.test_loader import _GGUF_LAYER_NAMES as _NAMES
from tests.quantization.test_gguf_native import _random_q4_k_blocks

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
ROWS, COLS = 70, 256  # rows not a multiple of the packed blocks' 32; columns one K-quant super-block
IDS = torch.tensor([[5, 69, 0, 5], [33, 31, 32, 64]])  # repeats, both ends, across block edges


def _blocks(type_name: str) -> np.ndarray:
    """Valid blocks [ROWS, COLS / block, bytes] of a type: gguf-py's quantizer where it has one, else
    random bytes under float16 factors of a real model's size (K-quants)."""
    rng = np.random.default_rng(7)
    if type_name == "Q4_K":
        return _random_q4_k_blocks(rng, ROWS, COLS // 256)
    if type_name == "Q6_K":
        blocks = rng.integers(0, 256, (ROWS, COLS // 256, 210), dtype=np.uint8)
        blocks[..., 208:210] = rng.uniform(1e-4, 2e-3, (ROWS, 1, 1)).astype(np.float16).view(np.uint8)
        return blocks
    raw = gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), Q[type_name])
    return raw.reshape(ROWS, COLS // 32, -1)


def _kernel(kind: str, weight, dtype: torch.dtype):
    if kind == "dequantize":
        return DequantizeKernel(weight, dtype)
    assert RoundedInputKernel.serves(weight, dtype, torch.device("cpu"))
    return RoundedInputKernel(weight, dtype)


KERNELS = ["dequantize", pytest.param("rounded", marks=pytest.mark.cpu_kernels)]


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_rows_equal_gguf_dequantize_of_those_rows(type_name, kind):
    blocks = _blocks(type_name)
    weight = gguf_native._READERS[type_name](blocks)  # noqa: SLF001 (the file's tensor as the engine reads it)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(ROWS, -1), Q[type_name]))
    kernel = _kernel(kind, weight, torch.float32)
    rows = kernel.weight_rows(IDS)
    assert rows.dtype == torch.float32 and torch.equal(rows, reference[IDS])
    assert not torch.equal(rows[0, 0], rows[0, 2])  # different rows really differ
    assert kernel.weight_rows(torch.empty(2, 0, dtype=torch.long)).shape == (2, 0, COLS)  # no lookups


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embedding_gives_the_float_tables_lookup(kind, dtype):
    """The module's lookup equals F.embedding over the float table the model would load (gguf-py's
    float32 rows, then the model's dtype), and its whole table equals that table."""
    blocks = _blocks("Q4_1")
    weight = gguf_native._READERS["Q4_1"](blocks)  # noqa: SLF001
    table = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(ROWS, -1), Q.Q4_1)).to(dtype)
    head = QuantizedLinear(weight, None, torch.float32, "cpu", float_logits=True)
    head.kernel = _kernel(kind, weight, torch.float32)
    embedding = HeadRowsEmbedding.of_quantized(head, range(ROWS), dtype, single_rank())
    assert torch.equal(embedding(IDS), torch.nn.functional.embedding(IDS, table))
    assert torch.equal(embedding.table(), table)


class _OneOfTwoRanks:
    """A tensor-parallel group of two whose all-reduce is left to the test (it sums the ranks)."""

    world_size = 2

    @staticmethod
    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_two_ranks_blocks_sum_to_the_whole_lookup():
    """Under tensor parallelism each rank's head holds its vocabulary block, padded with zero rows
    (quantization/sharding.py); each rank's lookup gives its block's rows and zeros elsewhere."""
    blocks = _blocks("Q8_0")
    weight = gguf_native._READERS["Q8_0"](blocks)  # noqa: SLF001
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(ROWS, -1), Q.Q8_0))
    per_rank = -(-ROWS // 2)
    total = torch.zeros(*IDS.shape, COLS)
    for rank in range(2):
        vocab = range(rank * per_rank, min((rank + 1) * per_rank, ROWS))
        part = shard_rows(weight, torch.arange(vocab.start, vocab.stop), per_rank)
        head = QuantizedLinear(part, None, torch.float32, "cpu", float_logits=True)
        head.kernel = DequantizeKernel(part, torch.float32)
        total += HeadRowsEmbedding.of_quantized(head, vocab, torch.float32, _OneOfTwoRanks())(IDS)
    assert torch.equal(total, reference[IDS])


def test_the_flag_survives_each_ranks_and_stages_part():
    """Under tensor or pipeline parallelism each rank's part of the result still says the head holds
    the embedding's values (each stage then swaps where it holds both modules)."""
    whole = methods.QuantizationResult({}, embedding_in_head=True)
    model = torch.nn.Module()
    assert sharding.on_this_stage(whole, model).embedding_in_head
    assert sharding.shard_result(whole, model).embedding_in_head


def test_a_kernel_with_rounded_scales_gives_no_rows():
    """bf16 scales are not the file's values: that kernel gives no rows (the embedding stays float)."""
    weight = gguf_native._READERS["Q8_0"](_blocks("Q8_0"))  # noqa: SLF001
    assert DequantizeKernel(weight, torch.bfloat16).weight_rows(IDS) is None


# -- a tied tiny Llama written as a GGUF, served with --quantization gguf --------------------------

VOCAB, HIDDEN, LAYERS = 97, 64, 2
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def write_tied_gguf(path, embedding_type, projection_type=Q.Q4_0, types: dict | None = None) -> None:
    """A tied tiny random Llama (no `output` tensor): token_embd in `embedding_type`, projections in
    `projection_type` (`types`: another for some tensors, by GGUF name), norms in float32. The q/k
    rows are written as they are: the test compares two runs of this one file, not the file against
    transformers."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_block_count, LAYERS),
        (writer.add_context_length, TINY["max_position_embeddings"]),
        (writer.add_embedding_length, HIDDEN),
        (writer.add_feed_forward_length, TINY["intermediate_size"]),
        (writer.add_head_count, TINY["num_attention_heads"]),
        (writer.add_head_count_kv, TINY["num_key_value_heads"]),
        (writer.add_layer_norm_rms_eps, TINY["rms_norm_eps"]),
        (writer.add_vocab_size, VOCAB),
    ]:
        add(value)
    _tokenizer(writer)
    for name, tensor in model.state_dict().items():
        array = np.ascontiguousarray(tensor.detach().float().numpy())
        if name == "lm_head.weight":
            continue  # tied: the file has token_embd only
        if name == "model.embed_tokens.weight":
            gguf_name, qtype = "token_embd.weight", embedding_type
        elif name == "model.norm.weight":
            gguf_name, qtype = "output_norm.weight", None
        else:
            layer, module = name.split(".")[2], name.split(".", 3)[3].rpartition(".")[0]
            gguf_name = f"blk.{layer}.{_NAMES[module]}.weight"
            qtype = None if array.ndim == 1 else (types or {}).get(gguf_name, projection_type)
        if qtype is None:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


ENGINE = dict(quantization="gguf", max_model_len=128, kv_cache_memory="8MiB", enforce_eager=True)


def _run(path: str, dtype: str) -> tuple[torch.Tensor, list[int], int, torch.nn.Module]:
    llm = LLM(path, dtype=dtype, **ENGINE)
    try:
        prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
        logits = teacher_forced_logits(llm, prompt)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        (output,) = llm.generate([prompt[:7]], params, use_tqdm=False)
        runner = llm.engine.model_runner
        memory = weights_memory_bytes(runner.model, (runner.kv_cache,))
        assert memory == llm.engine.memory.weights_memory_bytes
        return logits, output.outputs[0].token_ids, memory, runner.model.model.embed_tokens
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("embedding_type", "dtype"), [(Q.Q8_0, "float32"), (Q.Q4_1, "bfloat16")], ids=["Q8_0-f32", "Q4_1-bf16"]
)
def test_a_tied_gguf_model_gives_the_float_lookups_logits_and_tokens(
    tmp_path, monkeypatch, embedding_type, dtype
):
    """The same file served twice: with the lookup from the head's quantized copy, and with the float
    table as before (the swap turned off). Logits and greedy tokens are equal bit for bit; the
    weights in memory drop by exactly the float table's bytes."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tied.gguf")
    write_tied_gguf(path, embedding_type)
    logits, tokens, memory, embedding = _run(path, dtype)
    assert isinstance(embedding, HeadRowsEmbedding)
    monkeypatch.setattr(methods, "embed_from_head", lambda model, dtype: False)
    float_logits, float_tokens, float_memory, float_embedding = _run(path, dtype)
    assert isinstance(float_embedding, torch.nn.Embedding)
    assert torch.equal(logits, float_logits)
    assert tokens == float_tokens
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    assert float_memory - memory == VOCAB * HIDDEN * element


@pytest.mark.cpu_kernels("bf16_linear")
@pytest.mark.parametrize("tied", [True, False])
def test_a_bf16_head_on_its_packed_copy_is_the_only_copy_of_the_table(tmp_path, monkeypatch, tied):
    """A bf16 model on the CPU's small-batch kernel: a tied embedding reads its rows from the head's
    packed copy (the same bf16 values) and the table is freed; an untied head's weight is freed, its
    rows read from the packed copy too. Logits and greedy tokens equal the run that keeps the table."""
    from llmserve.kernels.small_batch_linear import LogitsLinear
    from llmserve.spec_decode.proposers.draft_head import subset_lm_head_weight
    from llmserve.worker import model_loading
    from tests.helpers import make_tiny_llama_dir

    path = make_tiny_llama_dir(str(tmp_path / "model"), tie_word_embeddings=tied)

    def run():
        llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory="8MiB")
        try:
            prompt = torch.randint(3, 5000, (20,), generator=torch.Generator().manual_seed(1)).tolist()
            logits = teacher_forced_logits(llm, prompt)
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            (output,) = llm.generate([prompt[:7]], params, use_tqdm=False)
            runner = llm.engine.model_runner
            model = runner.model
            ids = torch.tensor([0, 5, 4096, 49151])
            rows = subset_lm_head_weight(model, ids)
            memory = weights_memory_bytes(model, (runner.kv_cache,))
            return logits, output.outputs[0].token_ids, memory, model, rows
        finally:
            llm.shutdown()

    logits, tokens, memory, model, rows = run()
    assert type(model.lm_head) is LogitsLinear and model.lm_head.weight is None
    assert isinstance(model.model.embed_tokens, HeadRowsEmbedding) == tied
    monkeypatch.setattr(model_loading, "embed_from_packed_head", lambda model: False)
    kept_logits, kept_tokens, kept_memory, kept_model, kept_rows = run()
    assert torch.equal(logits, kept_logits) and tokens == kept_tokens
    assert torch.equal(rows, kept_rows)
    table = kept_model.model.embed_tokens.weight
    assert kept_memory - memory == (table.numel() * table.element_size() if tied else 0)
