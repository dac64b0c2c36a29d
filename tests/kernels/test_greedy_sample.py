"""The compiled greedy sampler against torch.argmax: every shape the engine sends, ties, -inf rows."""

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.sample.sampler import greedy_token_ids

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 65])
@pytest.mark.parametrize("vocab", [5, 16, 17, 1000, 49152])
def test_equals_torch_argmax(dtype, rows, vocab):
    generator = torch.Generator().manual_seed(rows * 100_003 + vocab)
    logits = torch.randn(rows, vocab, generator=generator).to(dtype)
    if vocab > 8:  # equal maxima in different 16-lane groups and row parts: the first must win
        top = logits.max() + 1
        logits[:, vocab // 3] = top
        logits[:, (2 * vocab) // 3] = top
        logits[:, -1] = top
    logits[0] = float("-inf")  # a fully masked row: its first index, as torch
    if rows > 1:
        logits[1, : vocab // 2] = float("-inf")
    assert torch.equal(ops.greedy_sample(logits), logits.argmax(dim=-1))


def test_single_row_split_among_threads_keeps_the_first_maximum():
    """One row is split into parts for the threads: a later part's equal maximum must not win."""
    logits = torch.zeros(1, 49152)
    logits[0, 40_000] = 3.0
    logits[0, 30_000] = 3.0
    logits[0, 20] = 2.0
    assert ops.greedy_sample(logits).tolist() == [30_000]


def test_greedy_token_ids_takes_views_and_other_dtypes():
    logits = torch.randn(6, 300)
    assert torch.equal(greedy_token_ids(logits[::2]), logits[::2].argmax(dim=-1))  # not contiguous
    half = logits.to(torch.float16)
    assert torch.equal(greedy_token_ids(half), half.argmax(dim=-1))  # torch's path


def test_rejects_bad_input():
    with pytest.raises(RuntimeError):
        ops.greedy_sample(torch.randn(3, 4, 5))
    with pytest.raises(RuntimeError):
        ops.greedy_sample(torch.randn(3, 4).to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_many_equal_maxima_keep_the_first(dtype):
    """Logits of three values: every row has its maximum in many lanes and vector sets at once."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (40, 4099), generator=generator).to(dtype)
    logits[:, :200] = 0  # the first maximum is past the first vectors
    assert torch.equal(ops.greedy_sample(logits), logits.argmax(dim=-1))
