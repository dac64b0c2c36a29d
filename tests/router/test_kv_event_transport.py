"""The ZMQ publisher and the router's subscriber on loopback: in order, gaps filled by replay, a late
subscriber catching up, a restarted publisher rebuilding the index."""

import pytest

from llmserve.config.kv_events import KVEventsConfig
from llmserve.core.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from llmserve.engine.kv_event_publisher import KVEventPublisher
from llmserve.router.events import KVEventSubscriber
from llmserve.router.index import PrefixIndex
from llmserve.router.prompt import block_hashes
from tests.entrypoints.conftest import free_port
from tests.helpers import wait_until

HASHES = block_hashes(list(range(40)), 4)


def stored(*indices):
    return [BlockStored([HASHES[i] for i in indices], None, [0] * 4 * len(indices), 4, None, None)]


@pytest.fixture
def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def publisher(endpoints, replay=True, **options):
    endpoint, replay_endpoint = endpoints
    config = KVEventsConfig(True, "zmq", endpoint, replay_endpoint if replay else None, **options)
    return KVEventPublisher(config)


def subscriber(endpoints, replay=True):
    index = PrefixIndex(["r"])
    sub = KVEventSubscriber(index)
    sub.add("r", endpoints[0], endpoints[1] if replay else None, "")
    sub.start()
    return sub, index


def test_a_late_subscriber_replays_from_the_start_then_follows(endpoints):
    pub = publisher(endpoints)
    try:
        for i in range(3):
            pub.publish(stored(i))
        pub.publish([BlockRemoved([HASHES[1]], None)])
        # late: joins once all four are sent (a replay served between two sends would return only the
        # first ones, and a SUB socket still joining misses the rest until the next batch shows the gap)
        published(pub, 4)
        sub, index = subscriber(endpoints)
        try:
            wait_until(lambda: index.stored("r") == {HASHES[0], HASHES[2]})  # replayed: 1 was removed
            pub.publish(stored(5))
            wait_until(lambda: HASHES[5] in index.stored("r"))  # then followed live
            assert index.stored("r") == {HASHES[0], HASHES[2], HASHES[5]}
        finally:
            sub.stop()
    finally:
        pub.shutdown()


def feed_of(endpoints):
    """A subscriber whose feed is driven by hand (no thread): batches are handed to it as if received."""
    index = PrefixIndex(["r"])
    sub = KVEventSubscriber(index)
    sub.add("r", endpoints[0], endpoints[1], "")
    return sub, next(iter(sub._feeds.values())), index


def published(pub, count):
    wait_until(lambda: len(pub._buffer) == count)
    return [payload for _, payload in pub._buffer]


@pytest.mark.parametrize(("buffer_steps", "expected"), [(10, {0, 1, 2}), (1, {2})])
def test_a_gap_is_filled_by_replay_or_else_clears_the_index(endpoints, buffer_steps, expected):
    pub = publisher(endpoints, buffer_steps=buffer_steps)
    sub, feed, index = feed_of(endpoints)
    try:
        for i in range(3):
            pub.publish(stored(i))
        payloads = published(pub, min(3, buffer_steps))
        sub._apply(feed, 0, encode_stored(0))
        sub._on_batch(feed, 2, payloads[-1])  # seq 1 never arrived: replay from 1
        assert index.stored("r") == {HASHES[i] for i in expected}
        assert feed.last_seq == 2
    finally:
        sub.stop()
        pub.shutdown()


def test_the_sub_sockets_copies_of_replayed_batches_are_skipped(endpoints):
    pub = publisher(endpoints)
    sub, feed, index = feed_of(endpoints)
    try:
        for i in range(3):
            pub.publish(stored(i))
        payloads = published(pub, 3)
        sub._replay_from(feed, 0)  # as at start: batches 0..2 by replay
        index.clear("r")
        for seq, payload in enumerate(payloads):  # then the same batches off the SUB socket
            sub._on_batch(feed, seq, payload)
        assert index.stored("r") == set() and feed.last_seq == 2, "a copy is neither applied nor a restart"
    finally:
        sub.stop()
        pub.shutdown()


def test_a_restarted_publisher_rebuilds_the_index(endpoints):
    sub, feed, index = feed_of(endpoints)
    for seq in range(4):
        sub._apply(feed, seq, encode_stored(seq))
    sub._on_batch(feed, 0, encode_stored(9))  # sequence 0 again: the replica restarted
    assert index.stored("r") == {HASHES[9]} and feed.last_seq == 0
    sub.stop()


def encode_stored(i):
    return encode_batch(KVEventBatch(ts=0.0, events=stored(i)))
