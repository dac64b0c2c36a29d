"""Each reduction a row takes part in, under --deterministic (worker/batch_invariance.py): one row's
output is bit-identical whatever rows surround it, however many there are, and wherever it sits.
`make test-avx2` runs these at the AVX2 level too (its bf16 layers took oneDNN's GEMM above 256 rows,
summing in another order than the kernel's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmserve.attention.backends.cpu_paged import CPUPagedBackend, span_pieces
from llmserve.forward_context import AttentionMetadata
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.kernels.small_batch_linear import use_small_batch_linear
from llmserve.models.layers.lm_head import LMHead
from llmserve.models.layers.norm import RMSNorm
from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.sampler import Sampler, mass_above
from llmserve.sampling_params import SamplingParams
from llmserve.worker.batch_invariance import make_batch_invariant

pytestmark = pytest.mark.cpu_kernels

ROW_COUNTS = [1, 2, 3, 8, 9, 16, 17, 100, 256, 257, 300]
BLOCK = 16


def assert_row_invariant(forward, rows: torch.Tensor) -> None:
    """Every row gets bitwise what it gets alone, at every row count, in order or reversed."""
    alone = torch.cat([forward(rows[index : index + 1].contiguous()) for index in range(len(rows))])
    for count in ROW_COUNTS:
        assert torch.equal(forward(rows[:count].contiguous()), alone[:count]), f"{count} rows"
        assert torch.equal(forward(rows[:count].flip(0)), alone[:count].flip(0)), f"{count} rows reversed"


def invariant_layers(dtype: torch.dtype) -> nn.Module:
    """A layer of the default model's widths and an output projection, swapped and made invariant."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 1536, bias=False), LMHead(576, 1000, bias=False))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.to(dtype)
    assert use_small_batch_linear(model) == 2
    make_batch_invariant(model, None)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_layers_and_logits(dtype):
    """Every row count on the dtype's compiled kernel: no switch to oneDNN or AMX above 8 or 256 rows."""
    layer, head = invariant_layers(dtype)
    rows = torch.randn(300, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        assert_row_invariant(layer, rows)
        assert_row_invariant(head, rows)
        assert head(rows[:1]).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual(dtype):
    norm = RMSNorm(576, 1e-5).to(dtype)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    rows = torch.randn(300, 576, generator=gen).to(dtype)
    residual = torch.randn(300, 576, generator=gen).to(dtype)
    with torch.inference_mode():
        assert_row_invariant(norm, rows)
        # the residual's rows go with x's (the sum of the pair, normalized)
        pairs = torch.cat([rows, residual], dim=1)
        assert_row_invariant(lambda p: norm(p[:, :576].clone(), p[:, 576:].clone())[0], pairs)


def test_span_pieces():
    """Spans of 40 and 3 queries over 100 and 20 positions, in pieces of 16."""
    tables = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [1, 2, 0, 0, 0, 0, 0]])
    tables_out, lens, starts = span_pieces(tables, torch.tensor([100, 20]), torch.tensor([0, 40, 43]), 16)
    assert lens.tolist() == [76, 92, 100, 20]  # 60 before the span, then 16, 16 and 8 of its queries
    assert starts.tolist() == [0, 16, 32, 40, 43]
    assert tables_out.tolist() == [tables[0].tolist()] * 3 + [tables[1].tolist()]
    short = span_pieces(tables, torch.tensor([100, 20]), torch.tensor([0, 16, 19]), 16)
    assert [t.tolist() for t in short] == [tables.tolist(), [100, 20], [0, 16, 19]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_of_a_prompt_chunk_is_its_tokens_decodes(dtype, head_dim):
    """Under --deterministic every span goes to the paged kernel (in pieces of 16 queries): a query
    token of a chunk of 100, or of 37 beside another sequence's decode, attends as the decode of that
    token over the context up to it; by default long spans took the prefill kernel."""
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(head_dim)
    spans = [(1, 50), (100, 130), (37, 37)]  # (query tokens, context length)
    num_blocks = len(spans) * 9 + 2
    key_cache, value_cache = (
        torch.randn(num_blocks * BLOCK, 3, head_dim, generator=gen).to(dtype) for _ in "kv"
    )
    tables = torch.randperm(num_blocks, generator=gen)[: len(spans) * 9].view(len(spans), 9)
    counts = [q for q, _ in spans]
    query = torch.randn(sum(counts), 9, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *counts]).cumsum(0)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(sum(counts), dtype=torch.int64),
        num_decode_tokens=sum(counts),
        decode_context_slots=None,
        decode_context_mask=None,
        prefills=[],
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor([ctx for _, ctx in spans]),
        decode_query_starts=starts,
        block_size=BLOCK,
    )
    backend = CPUPagedBackend()
    make_batch_invariant(nn.Module(), backend)
    assert backend.max_decode_query_len > max(counts)  # the input builder sends every span to _decode
    scale = head_dim**-0.5
    out = backend._decode(query, key_cache, value_cache, metadata, scale)
    owners = [seq for seq, (q, _) in enumerate(spans) for _ in range(q)]
    decode_lens = [ctx - q + 1 + i for q, ctx in spans for i in range(q)]
    decodes = ops.paged_attention(
        query, key_cache, value_cache, tables[owners].contiguous(), torch.tensor(decode_lens),
        torch.arange(len(owners) + 1), BLOCK, scale, 0, 0, 0,
    )  # fmt: skip
    assert torch.equal(out, decodes)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]):
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    n = len(params)
    metadata = SamplingMetadata.build(
        params, [[1]] * n, [[]] * n, generators, [(2,)] * n, logits.shape[1], torch.device("cpu")
    )
    return Sampler()(logits, metadata)


def test_sampler_rows_do_not_depend_on_the_batch():
    """Greedy rows with logprobs (argmax, log-softmax) and seeded rows at temperature > 0 with top-k
    and top-p give the same token and logprobs alone and among other rows, which need more top-k
    candidates, sample unseeded or ask for more logprobs."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 8192, generator=gen) * 4
    greedy = SamplingParams(temperature=0, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.8, logprobs=2, seed=11)
    others = [SamplingParams(temperature=1.0, top_k=400, top_p=0.9, logprobs=5), greedy, seeded]
    for params, seed in ((greedy, None), (seeded, 11)):
        alone = sample(logits[:1].clone(), [params], [seed])
        for count in (2, 5, 64):
            batch = [params] + [others[i % 3] for i in range(count - 1)]
            seeds = [seed] + [11 if p is seeded else None for p in batch[1:]]
            together = sample(logits[:count].clone(), batch, seeds)
            assert together.sampled_token_ids[0] == alone.sampled_token_ids[0]
            assert torch.equal(together.sampled_logprobs[:1], alone.sampled_logprobs)
            assert torch.equal(together.logprobs[0, :2], alone.logprobs[0, :2])


def test_top_p_mass_does_not_depend_on_the_candidates_other_rows_need():
    """A top-k row's top-p mass over its k candidates, or over more of which the rest are masked (the
    batch's largest top_k, or the whole vocabulary): the same bits (a softmax's sum differed)."""
    gen = torch.Generator().manual_seed(4)
    for k in (5, 17, 50, 133):
        top = (torch.randn(8, 8192, generator=gen) * 3).topk(k).values
        for candidates in (k + 7, 400, 8192):
            padded = torch.cat([top, torch.full((8, candidates - k), float("-inf"))], dim=1)
            assert torch.equal(mass_above(padded)[:, :k], mass_above(top))
