"""The compiled K/V row write against index_copy_, through the KV cache format that uses it."""

import pytest
import torch

from llmserve.attention.kv_format import get_kv_cache_format
from llmserve.kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 700])
def test_write_matches_index_copy(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    kv_heads, head_dim = 3, 64
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    key = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)  # strided rows
    slots = torch.randperm(1024, generator=gen)[:tokens]
    expected = torch.randn(1024, kv_heads, head_dim, generator=gen).to(dtype)
    actual = expected.clone()
    expected.index_copy_(0, slots, key)
    get_kv_cache_format("auto").write(actual, slots, key)
    assert torch.equal(actual, expected)


def test_write_rejects_slots_outside_the_pool():
    cache = torch.zeros(8, 1, 4)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv_rows(cache, torch.tensor([3, 8]), torch.ones(2, 1, 4))
