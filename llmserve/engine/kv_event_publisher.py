"""Publishes the engine's KV-cache events over ZMQ, as vLLM's `ZmqEventPublisher` does.

The engine's main thread only numbers each step's batch and queues it (`publish`); the
`llmserve-kv-events` thread encodes and sends it, so the step loop never waits on the network.

Wire protocol (the one vLLM's subscribers speak):
- PUB socket at `endpoint`: multipart [topic, seq (8 bytes, big-endian), msgpack KVEventBatch].
  Sequence numbers count batches from 0 without gaps; a subscriber that sees one missing lost it.
- ROUTER socket at `replay_endpoint` (optional): a request holding a start seq (8 bytes) is answered
  with every buffered batch from that seq on, each as [seq, payload], then [-1 as 8 bytes, b""].
  The last `buffer_steps` batches are kept. A batch dropped because the queue was full is never sent,
  so its seq is a gap that replay cannot fill: the subscriber then knows to resynchronize.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from llmserve.config.kv_events import KVEventsConfig
from llmserve.core.kv_events import KVCacheEvent, KVEventBatch, encode_batch

logger = logging.getLogger("llmserve")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_REPLAY_POLL_SECONDS = 0.05  # while no batch arrives, how often replay requests are looked at


class KVEventPublisher:
    """Binds at construction (a busy endpoint fails at start-up), sends from its own thread."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0
        self._next_seq = 0
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(config.max_queue_size)
        self._context = zmq.Context()
        self._pub = self._bind(zmq.PUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay = self._bind(zmq.ROUTER, config.replay_endpoint) if config.replay_endpoint else None
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._run, name="llmserve-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as error:
            sock.close()
            self._context.term()
            raise ValueError(f"--kv-events-config: cannot bind {endpoint}: {error}") from error
        return sock

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as the next batch; never blocks (a full queue drops the batch)."""
        if not events:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: the publisher is behind; %d batches dropped", self.num_dropped)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_REPLAY_POLL_SECONDS)
                except queue.Empty:
                    item = ()
                if item is None:
                    return
                if item:
                    self._send(*item)
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
        finally:
            for sock in (self._pub, self._replay):
                if sock is not None:
                    sock.close()
            self._context.term()

    def _send(self, seq: int, batch: KVEventBatch) -> None:
        seq_bytes, payload = seq.to_bytes(8, "big"), encode_batch(batch)
        self._buffer.append((seq_bytes, payload))
        self._pub.send_multipart((self._topic, seq_bytes, payload))

    def _serve_replay(self) -> None:
        identity, *frames = self._replay.recv_multipart()
        start = int.from_bytes(frames[-1], "big") if frames and len(frames[-1]) == 8 else 0
        envelope = [identity, b""] if len(frames) > 1 else [identity]  # REQ peers send an empty frame
        for seq_bytes, payload in list(self._buffer):
            if int.from_bytes(seq_bytes, "big") >= start:
                self._replay.send_multipart([*envelope, seq_bytes, payload])
        self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])
