"""Subscribes to every replica's KV events (engine/kv_event_publisher.py) and feeds the index.

One thread polls one SUB socket per replica. Sequence numbers must follow one another: a batch
already seen is skipped, a gap is filled from the replica's replay socket (a DEALER speaks to its
ROUTER), and a gap that replay cannot fill, or a sequence that starts again from 0 (the replica
restarted), clears that replica's index so it is rebuilt from what comes next rather than trusted
stale. At start every feed asks for a replay from 0, so a router that starts after its replicas
still learns what they cache. The publisher answers a replay between two sends, so the SUB socket's
copies of replayed batches all come before anything newer: they are skipped by number.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq

from llmserve.core.kv_events import decode_batch
from llmserve.router.index import PrefixIndex

logger = logging.getLogger("llmserve.router")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 100
REPLAY_TIMEOUT_MS = 2000


def connect_endpoint(bind_endpoint: str, replica_url: str) -> str:
    """The address to connect to for an endpoint the replica bound: a wildcard host becomes the
    replica's own host (`tcp://*:5557` on http://10.0.0.2:8000 is tcp://10.0.0.2:5557)."""
    scheme, _, rest = bind_endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme == "tcp" and sep and host in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{urlsplit(replica_url).hostname}:{port}"
    return bind_endpoint


@dataclass
class _Feed:
    replica: str
    sub: zmq.Socket
    replay: zmq.Socket | None
    last_seq: int = -1  # the last batch applied; -1: none yet
    replayed_to: int = 0  # batches below this came by replay: their copies on the SUB socket are stale


class KVEventSubscriber:
    """`add` every replica before `start`; `stop` closes the sockets."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._context = zmq.Context()
        self._feeds: dict[zmq.Socket, _Feed] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-router-events", daemon=True)

    def add(self, replica: str, endpoint: str, replay_endpoint: str | None, topic: str) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.connect(connect_endpoint(endpoint, replica))
        replay = None
        if replay_endpoint is not None:
            replay = self._context.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(connect_endpoint(replay_endpoint, replica))
        self._feeds[sub] = _Feed(replica, sub, replay)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        else:
            self._close()

    def _close(self) -> None:
        for feed in self._feeds.values():
            feed.sub.close()
            if feed.replay is not None:
                feed.replay.close()
        self._context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for feed in self._feeds.values():
            poller.register(feed.sub, zmq.POLLIN)
            self._replay_from(feed, 0)
        try:
            while not self._stopping.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    _topic, seq_bytes, payload = sock.recv_multipart()
                    self._on_batch(self._feeds[sock], int.from_bytes(seq_bytes, "big"), payload)
        finally:
            self._close()

    def _on_batch(self, feed: _Feed, seq: int, payload: bytes) -> None:
        if seq < feed.replayed_to:
            return  # published before a replay that brought it already
        feed.replayed_to = 0
        if seq <= feed.last_seq:
            logger.info("replica %s restarted its KV events; rebuilding its index", feed.replica)
            self.index.clear(feed.replica)
            feed.last_seq = -1
        if seq > feed.last_seq + 1:
            self._replay_from(feed, feed.last_seq + 1)
            if seq <= feed.last_seq:
                return
            if seq > feed.last_seq + 1:
                first_lost = feed.last_seq + 1
                logger.warning(
                    "replica %s: KV events %d..%d lost; rebuilding its index",
                    feed.replica,
                    first_lost,
                    seq - 1,
                )
                self.index.clear(feed.replica)
        self._apply(feed, seq, payload)

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning("replica %s sent a malformed KV event batch %d: %s", feed.replica, seq, error)
            self.index.clear(feed.replica)
        else:
            self.index.apply(feed.replica, batch)
        feed.last_seq = seq

    def _replay_from(self, feed: _Feed, start: int) -> None:
        """Apply the replica's buffered batches from `start` on, as far as they follow on."""
        if feed.replay is None:
            return
        feed.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while feed.replay.poll(REPLAY_TIMEOUT_MS):
            _, seq_bytes, payload = feed.replay.recv_multipart()
            if seq_bytes == END_OF_REPLAY:
                return
            seq = int.from_bytes(seq_bytes, "big")
            fresh = feed.last_seq == -1  # a fresh feed takes whatever the buffer still holds
            if seq == feed.last_seq + 1 or (fresh and seq > 0):
                self._apply(feed, seq, payload)
                feed.replayed_to = seq + 1
        logger.warning("replica %s did not answer a KV-event replay request", feed.replica)
