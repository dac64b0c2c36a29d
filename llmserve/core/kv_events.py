"""KV-cache events in vLLM's wire format (`vllm.distributed.kv_events`), so its subscribers work as is.

The block pool reports every change to its prefix-cache index: `BlockStored` when full blocks are
registered under their hashes, `BlockRemoved` when a cached block is handed out again (evicted), and
`AllBlocksCleared` when the whole index is dropped. Replaying the events of a pool from its start
gives exactly the set of hashes it can hit, which is what a prefix-aware router needs.

The hashes are the engine's own (`prefix_cache.hash_block`, scheme `BLOCK_HASH_SCHEME`): a
subscriber that tokenizes a prompt and chains the same SHA-256 finds which blocks a replica holds.

On the wire (engine/kv_event_publisher.py) each step's events travel as one `KVEventBatch`,
msgpack-encoded, in a multipart message [topic, sequence number (8 bytes, big-endian), payload].
"""

from __future__ import annotations

from typing import Any

import msgspec

# The block-hash scheme: SHA-256 over the parent's 32-byte digest (empty for the first block), the
# block's token ids as native int64 and an extra key; a router hashes prompts this way.
BLOCK_HASH_SCHEME = "sha256-chained-int64"

MEDIUM_CPU = "CPU"  # vLLM's medium names the memory holding the block: "GPU", "CPU"
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall-clock time (time.time()) of the step that made the events
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the prefix-cache index; tagged by its class name on the wire."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]  # consecutive full blocks of one sequence, in order
    parent_block_hash: bytes | None  # the block before the first one; None at a sequence's start
    token_ids: list[int]  # the blocks' tokens, block_size per hash
    block_size: int
    lora_id: int | None  # no defaults: vLLM's decoders expect every field (array_like, omit_defaults)
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) on a malformed payload."""
    return _DECODER.decode(payload)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
