"""GET /server_info: what a prefix-aware router must know of a replica before sending it requests.

The router (llmserve/router/) routes on the replica's own block hashes, so it checks that it would
compute the same ones: the same block size, hash scheme and tokenizer (a fingerprint of the token
ids of a fixed text, chat markup included), and it learns where the replica publishes its KV events.
"""

from __future__ import annotations

import dataclasses
import hashlib

from pydantic import BaseModel

from llmserve.core.kv_events import BLOCK_HASH_SCHEME
from llmserve.model_loader.tokenizer import Tokenizer

# Words, digits, whitespace runs, non-ASCII and the default chat markup: tokenizers that agree on it
# agree on practically every prompt.
_PROBE_TEXT = "Hello, world! 12345 \t\n  naïve café — 你好 <|im_start|>user\nHi<|im_end|>\n"


class KVEventsEndpoints(BaseModel):
    endpoint: str  # the replica's ZMQ PUB endpoint as configured ("*" for the host: any address)
    replay_endpoint: str | None
    topic: str


class ServerInfo(BaseModel):
    model: str  # the served model name
    max_model_len: int
    block_size: int
    hash_scheme: str
    prefix_caching: bool
    tokenizer_fingerprint: str
    kv_events: KVEventsEndpoints | None  # None: this replica publishes no KV events
    # what the loaded model holds (worker/memory_report.py; rank 0's under tensor parallelism); None:
    # unknown. Defaults keep an older replica's answer valid; the router checks none of them.
    weights_memory_bytes: int | None = None
    weights_file_bytes: int | None = None
    engine_resident_bytes: int | None = None
    # whether a request's tokens and logprobs are bitwise the same whatever else runs (--deterministic,
    # worker/batch_invariance.py); None: unknown. The reasons name each component that is not.
    batch_invariant: bool | None = None
    batch_invariance_reasons: list[str] = []
    # prefill/decode disaggregation (--kv-transfer-config): kv_producer, kv_consumer or kv_both; None:
    # neither. The router checks it against --prefill-replica and --replica.
    kv_role: str | None = None
    # each served LoRA adapter's prefix-cache key (hex), which the engine mixes into the first block's
    # hash of the adapter's requests: the router hashes their prompts with it (docs/lora.md)
    lora_cache_keys: dict[str, str] = {}


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    ids = tokenizer.encode(_PROBE_TEXT)
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def server_info(
    served_model_name: str,
    config,
    tokenizer: Tokenizer,
    memory=None,
    batch_invariance=None,
    lora_cache_keys: dict[str, bytes] | None = None,
) -> ServerInfo:
    """`config`: the replica's EngineConfig; `memory`: its engine's MemoryReport, if it measured one;
    `batch_invariance`: why its engine is not batch invariant (() where it is; None: not reported);
    `lora_cache_keys`: its adapters' prefix-cache keys by name."""
    events = config.cache.kv_events
    sizes = {} if memory is None else dataclasses.asdict(memory)
    return ServerInfo(
        model=served_model_name,
        max_model_len=config.model.max_model_len,
        block_size=config.cache.block_size,
        hash_scheme=BLOCK_HASH_SCHEME,
        prefix_caching=config.cache.enable_prefix_caching,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        kv_events=None
        if events is None
        else KVEventsEndpoints(
            endpoint=events.endpoint, replay_endpoint=events.replay_endpoint, topic=events.topic
        ),
        batch_invariant=None if batch_invariance is None else not batch_invariance,
        batch_invariance_reasons=list(batch_invariance or ()),
        kv_role=None if config.cache.kv_transfer is None else config.cache.kv_transfer.kv_role,
        lora_cache_keys={name: key.hex() for name, key in (lora_cache_keys or {}).items()},
        **sizes,
    )
