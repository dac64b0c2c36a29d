"""Fixtures of the attention tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_head32(tmp_path_factory):
    """A tiny random Llama with head_dim 32 (2 heads of 32): the KV formats' engine tests (8-bit rows need
    an even head_dim, int4/int2 a multiple of 32)."""
    from tests.helpers import make_tiny_llama_dir

    return make_tiny_llama_dir(
        str(tmp_path_factory.mktemp("tiny_head32")), head_dim=32, num_attention_heads=2
    )
