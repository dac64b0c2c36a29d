"""RAM and disk tiers under the prefix cache, the scheduler's side: exact ops, slots, blocks and events
(core/kv_tiers.py); and the disk tier's file format (core/kv_block_file.py)."""

import os
import threading
import time
from pathlib import Path

import pytest

from llmserve.config import SchedulerConfig
from llmserve.core import kv_block_file, kv_tiers
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from llmserve.core.kv_tiers import TIER_BLOCK, TierSpec
from llmserve.core.prefix_cache import hash_block
from llmserve.core.scheduler import Scheduler
from tests.helpers import wait_until

from .test_scheduler import finish_step

SHARED = list(range(100, 112))  # three full blocks of 4
KEY = b"m" * 32
BLOCK_BYTES = 64


def make_scheduler(num_blocks=8, ram=8, disk_dir=None, disk=0, events=False, read_threads=0):
    """Disk files are read at once in the scheduler unless `read_threads` (exact ops per step)."""
    spec = TierSpec(ram, disk_dir, disk, KEY, BLOCK_BYTES, disk_read_threads=read_threads)
    kv = KVCacheManager(num_blocks, block_size=4, tiers=spec, enable_kv_events=events)
    return Scheduler(SchedulerConfig(64, 8, 1000), kv), kv


def run_to_end(scheduler, request):
    """Schedule the request (alone or beside others) until it finishes; the plans' tier ops."""
    scheduler.add_request(request)
    ops = []
    while not request.is_finished:
        output = scheduler.schedule()
        ops += output.plan.tier_ops
        finish_step(scheduler, output)
    return ops


def fill_pool(scheduler, make_request, num_blocks):
    """Run a prompt that takes every block of the pool: the cached blocks before it are evicted."""
    return run_to_end(scheduler, make_request(4 * num_blocks - 3, max_tokens=1))


def test_evicted_blocks_go_to_ram_and_a_hit_loads_them_into_fresh_blocks_of_its_own(make_request):
    scheduler, kv = make_scheduler(num_blocks=8, ram=16)
    run_to_end(scheduler, make_request(0, tokens=SHARED + [1], max_tokens=1))  # caches blocks 0-2
    ops = fill_pool(scheduler, make_request, 8)
    slots = {op.block: op.slot for op in ops if op.kind == "save"}
    assert set(slots) == {0, 1, 2} and [op.kind for op in ops] == ["save"] * 3
    bystander = make_request(5, max_tokens=50)  # runs beside the hit, holding blocks of its own
    scheduler.add_request(bystander)
    finish_step(scheduler, scheduler.schedule())

    again = make_request(0, tokens=SHARED + [7, 8])
    assert kv.get_computed_blocks(again) == [TIER_BLOCK] * 3
    scheduler.add_request(again)
    output = scheduler.schedule()
    table = kv.get_block_table(again.request_id)
    loads = [(op.slot, op.block) for op in output.plan.tier_ops if op.kind == "load"]
    assert loads == [(slots[block], table[i]) for i, block in enumerate([0, 1, 2])]
    assert again.num_computed_tokens == 12 and again.num_cached_tokens == 12
    # the loads' blocks are the new request's alone: not the bystander's, one reference each
    assert not set(kv.get_block_table(bystander.request_id)) & set(table[:3])
    assert [kv.pool.ref_counts[block] for block in table[:3]] == [1, 1, 1]
    assert kv.pool.tiers.counters["ram"].hits == 3
    kv.check_integrity()


def test_a_loaded_hit_is_shared_by_a_concurrent_request_with_the_same_prefix(make_request):
    scheduler, kv = make_scheduler(num_blocks=10, ram=16)
    run_to_end(scheduler, make_request(0, tokens=SHARED + [1], max_tokens=1))
    fill_pool(scheduler, make_request, 10)
    first, second = make_request(0, tokens=SHARED + [7]), make_request(0, tokens=SHARED + [9])
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert [op.kind for op in output.plan.tier_ops].count("load") == 3  # loaded once
    assert kv.get_block_table(first.request_id)[:3] == kv.get_block_table(second.request_id)[:3]
    assert second.num_cached_tokens == 12
    kv.check_integrity()


def test_entries_a_hit_loads_from_are_pinned_while_its_blocks_are_allocated(make_request):
    scheduler, kv = make_scheduler(num_blocks=5, ram=3, events=True)
    run_to_end(scheduler, make_request(0, tokens=SHARED + [1], max_tokens=1))
    fill_pool(scheduler, make_request, 5)  # 0-2 to RAM, which is then full
    kv.take_events()
    # the hit's own allocation evicts two cached blocks of the filler: the RAM tier holds only the
    # hit's entries, so those two are dropped (and reported), never saved over a slot being read;
    # the request's new block, allocated after the loads are queued, may reuse a slot
    again = make_request(0, tokens=SHARED + [7, 8])
    scheduler.add_request(again)
    output = scheduler.schedule()
    assert [op.kind for op in output.plan.tier_ops] == ["load"] * 3 + ["save"]
    removed = [h for event in kv.take_events() if isinstance(event, BlockRemoved) for h in event.block_hashes]
    assert len(removed) == 2
    kv.check_integrity()


def test_kv_events_report_a_block_removed_only_when_no_tier_holds_it(make_request):
    scheduler, kv = make_scheduler(num_blocks=4, ram=3, events=True)
    run_to_end(scheduler, make_request(0, tokens=SHARED + [1], max_tokens=1))
    stored = [h for event in kv.take_events() if isinstance(event, BlockStored) for h in event.block_hashes]
    run_to_end(scheduler, make_request(0, tokens=list(range(500, 513)), max_tokens=1))  # 0-2 to RAM
    events = kv.take_events()
    assert not [event for event in events if isinstance(event, BlockRemoved)]  # held in RAM
    run_to_end(scheduler, make_request(0, tokens=list(range(600, 613)), max_tokens=1))  # RAM overflows
    removed = [event for event in kv.take_events() if isinstance(event, BlockRemoved)]
    assert {h for event in removed for h in event.block_hashes} == set(stored)
    assert {event.medium for event in removed} == {MEDIUM_CPU}


def test_ram_overflow_moves_blocks_to_the_disk_tier_which_a_restart_finds(make_request, tmp_path):
    scheduler, kv = make_scheduler(num_blocks=4, ram=3, disk_dir=tmp_path, disk=8)
    run_to_end(scheduler, make_request(0, tokens=SHARED + [1], max_tokens=1))
    run_to_end(scheduler, make_request(0, tokens=list(range(500, 513)), max_tokens=1))
    ops = run_to_end(scheduler, make_request(0, tokens=list(range(600, 613)), max_tokens=1))
    demotes = [op for op in ops if op.kind == "demote"]
    assert sorted(op.tokens for op in demotes) == [tuple(SHARED[i : i + 4]) for i in (0, 4, 8)]
    payloads = {op.block_hash: bytes([op.slot]) * BLOCK_BYTES for op in demotes}
    for op in demotes:  # as the model runner writes them
        path = kv_block_file.block_path(tmp_path, op.block_hash)
        kv_block_file.write_block(path, KEY, op.block_hash, op.tokens, payloads[op.block_hash])

    restarted, kv = make_scheduler(num_blocks=4, ram=3, disk_dir=tmp_path, disk=8)
    again = make_request(0, tokens=SHARED + [7])
    restarted.add_request(again)
    output = restarted.schedule()
    loads = [op for op in output.plan.tier_ops if op.kind == "load_bytes"]
    hashes = kv.prefix_cache.block_hashes(again)[:3]
    assert [op.payload for op in loads] == [payloads[block_hash] for block_hash in hashes]
    assert [op.block for op in loads] == kv.get_block_table(again.request_id)[:3]
    assert again.num_cached_tokens == 12 and kv.pool.tiers.counters["disk"].hits == 3


def test_after_a_failed_write_the_disk_tier_drops_the_unwritten_blocks_and_takes_no_more(
    make_request, tmp_path
):
    good = hash_block(b"", (1, 2, 3, 4))
    kv_block_file.write_block(kv_block_file.block_path(tmp_path, good), KEY, good, (1, 2, 3, 4), bytes(64))
    scheduler, kv = make_scheduler(num_blocks=4, ram=3, disk_dir=tmp_path, disk=4)
    run_to_end(scheduler, make_request(0, tokens=SHARED + [1], max_tokens=1))
    run_to_end(scheduler, make_request(0, tokens=list(range(500, 513)), max_tokens=1))
    ops = run_to_end(scheduler, make_request(0, tokens=list(range(600, 613)), max_tokens=1))
    unwritten = [op.block_hash for op in ops if op.kind == "demote"]
    assert len(unwritten) == 3
    kv.pool.tiers.writes_failed(unwritten)  # as the engine hands on the model runner's report
    assert list(kv.pool.tiers.disk.entries) == [good]
    for start in (700, 800, 900):  # RAM overflows again: nothing goes to disk, the good file stays
        ops = run_to_end(scheduler, make_request(0, tokens=list(range(start, start + 13)), max_tokens=1))
        assert not [op for op in ops if op.kind in ("demote", "delete")]
    assert list(kv.pool.tiers.disk.entries) == [good]
    kv.check_integrity()


def test_a_bad_file_refuses_one_admission_then_the_hit_stops_before_it(make_request, tmp_path):
    blocks = [tuple(SHARED[i : i + 4]) for i in (0, 4, 8)]
    hashes, parent = [], b""
    for tokens in blocks:
        parent = hash_block(parent, tokens)
        hashes.append(parent)
        kv_block_file.write_block(kv_block_file.block_path(tmp_path, parent), KEY, parent, tokens, bytes(64))
    path = kv_block_file.block_path(tmp_path, hashes[1])
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")  # a flipped byte: the checksum fails
    scheduler, kv = make_scheduler(disk_dir=tmp_path, disk=8)
    request = make_request(0, tokens=SHARED + [7])
    scheduler.add_request(request)
    assert scheduler.schedule().plan.tier_ops[0].kind == "delete"  # refused; the bad file goes
    output = scheduler.schedule()
    assert [op.kind for op in output.plan.tier_ops] == ["load_bytes"]
    assert request.num_cached_tokens == 4
    kv.check_integrity()


def test_a_failed_read_is_forgotten_with_its_file_so_the_block_written_again_hits(
    make_request, tmp_path, caplog
):
    tokens = tuple(SHARED[:4])
    block_hash = hash_block(b"", tokens)
    path = kv_block_file.block_path(tmp_path, block_hash)
    kv_block_file.write_block(path, KEY, block_hash, tokens, bytes(64))
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")  # the checksum fails; the header is indexed
    scheduler, kv = make_scheduler(num_blocks=4, ram=1, disk_dir=tmp_path, disk=1)
    gone = make_request(0, tokens=list(tokens) + [7])
    assert kv.tier_hit_ready(gone, [TIER_BLOCK])  # its read fails; the request goes away unadmitted
    written = set()

    def run_and_write(request):  # as the model runner runs the ops
        for op in run_to_end(scheduler, request):
            if op.kind == "demote":
                target = kv_block_file.block_path(tmp_path, op.block_hash)
                kv_block_file.write_block(target, KEY, op.block_hash, op.tokens, bytes(64))
                written.add(op.block_hash)

    run_and_write(make_request(5))  # its block pushes the bad file off the one-file disk tier
    for start in (500, 600):
        run_and_write(make_request(0, tokens=list(range(start, start + 13)), max_tokens=1))
    assert block_hash not in kv.pool.tiers.disk.entries
    run_and_write(make_request(0, tokens=list(tokens) + [1], max_tokens=1))  # computed again
    for _ in range(8):  # one block evicted at a time until its file is written again
        run_and_write(make_request(4, max_tokens=1))
        if block_hash in kv.pool.tiers.disk.entries:
            break
    assert block_hash in written and block_hash in kv.pool.tiers.disk.entries
    again = make_request(0, tokens=list(tokens) + [9])
    scheduler.add_request(again)
    with caplog.at_level("WARNING", logger="llmserve"):
        ops = scheduler.schedule().plan.tier_ops
    # loaded at once (its own allocation may then push the file off the one-file tier), no warning
    assert [op.kind for op in ops].count("load_bytes") == 1 and again.num_cached_tokens == 4
    assert not [record for record in caplog.records if "corrupt" in record.getMessage()]
    kv.check_integrity()


def test_a_request_waits_for_its_disk_reads_while_the_others_run(make_request, tmp_path, monkeypatch):
    parent, tokens = b"", tuple(SHARED[:4])
    block_hash = hash_block(parent, tokens)
    kv_block_file.write_block(
        kv_block_file.block_path(tmp_path, block_hash), KEY, block_hash, tokens, bytes(64)
    )
    release, read = threading.Event(), kv_block_file.read_block

    def slow_read(*args):
        release.wait(30)
        return read(*args)

    monkeypatch.setattr(kv_block_file, "read_block", slow_read)
    scheduler, kv = make_scheduler(disk_dir=tmp_path, disk=8, read_threads=1)
    waiting, other = make_request(0, tokens=SHARED[:4] + [7]), make_request(6)
    scheduler.add_request(waiting)
    scheduler.add_request(other)
    output = scheduler.schedule()  # the read has started; the request behind goes first
    assert [r.request_id for r in output.requests] == [other.request_id]
    finish_step(scheduler, output)
    assert [r.request_id for r in scheduler.schedule().requests] == [other.request_id]
    release.set()
    wait_until(lambda: kv.tier_hit_ready(waiting, [TIER_BLOCK]))
    output = scheduler.schedule()
    assert waiting in output.requests and waiting.num_cached_tokens == 4
    (load,) = output.plan.tier_ops
    assert load.kind == "load_bytes" and load.block == kv.get_block_table(waiting.request_id)[0]
    kv.check_integrity()


def test_block_files_are_read_only_whole_ours_and_unchanged(tmp_path: Path):
    tokens, block_hash = (5, 6, 7, 8), b"h" * 32
    path = kv_block_file.block_path(tmp_path, block_hash)
    kv_block_file.write_block(path, KEY, block_hash, tokens, b"kv" * 32)
    assert kv_block_file.read_block(path, KEY, block_hash, tokens) == b"kv" * 32
    assert kv_block_file.read_block(path, b"x" * 32, block_hash, tokens) is None  # another model's
    assert kv_block_file.read_block(path, KEY, block_hash, (5, 6, 7, 9)) is None  # other tokens
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # truncated
    assert kv_block_file.read_block(path, KEY, block_hash, tokens) is None
    assert list(kv_block_file.scan(tmp_path, KEY)) == []
    path.write_bytes(whole[:100] + bytes([whole[100] ^ 1]) + whole[101:])  # one bit flipped
    assert kv_block_file.read_block(path, KEY, block_hash, tokens) is None
    path.write_bytes(whole)
    assert [header.tokens for header, _ in kv_block_file.scan(tmp_path, KEY)] == [tokens]
    assert list(kv_block_file.scan(tmp_path, b"x" * 32)) == []
    path.rename(tmp_path / ("0" * 64 + kv_block_file.SUFFIX))  # not under its own hash
    assert list(kv_block_file.scan(tmp_path, KEY)) == []


def test_start_up_deletes_only_the_temporary_files_of_dead_writes(tmp_path: Path, monkeypatch):
    path = kv_block_file.block_path(tmp_path, b"h" * 32)
    live, mine_too = kv_block_file.temporary_path(path), kv_block_file.temporary_path(path)
    assert live != mine_too and f"-{os.getpid()}-" in live.name  # each write its own name
    renamed, replace = [], os.replace
    monkeypatch.setattr(
        os, "replace", lambda source, target: renamed.append(Path(source)) or replace(source, target)
    )
    kv_block_file.write_block(path, KEY, b"h" * 32, (1, 2, 3, 4), bytes(64))
    assert len(renamed) == 1 and f"-{os.getpid()}-" in renamed[0].name  # written under its own name
    monkeypatch.undo()
    path.unlink()
    host = live.name.removesuffix(".tmp").rsplit(".", 1)[-1].split("-")[0]
    dead = path.with_name(f"{path.name}.{host}-{(1 << 22) + 1}-0.tmp")  # past Linux's largest pid
    old = path.with_name(path.name + ".tmp")  # an older name: its age alone tells
    other_host = path.with_name(f"{path.name}.ffffffff-1-0.tmp")  # pid 1 of another host
    for temporary in (live, dead, old, other_host):
        temporary.write_bytes(b"partial")
    minutes_ago = time.time() - 120
    os.utime(old, (minutes_ago, minutes_ago))
    make_scheduler(disk_dir=tmp_path, disk=8)  # another server starting on the folder
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other_host.name])
    os.utime(other_host, (minutes_ago, minutes_ago))
    kv_block_file.remove_dead_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [live.name]


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(kv_offloading_size=0), "positive number of GiB"),
        (dict(kv_offloading_size=1, kv_offloading_disk_dir="/tmp/x"), "go together"),
        (dict(kv_offloading_disk_size=1.0), "need --kv-offloading-size"),
        (
            dict(kv_offloading_size=1, kv_offloading_disk_dir="/tmp/x", kv_offloading_disk_size=-1),
            "disk-size",
        ),
    ],
)
def test_bad_offloading_flags_are_one_line_errors(flags, message):
    from llmserve.config import EngineArgs

    with pytest.raises(ValueError, match=message) as error:
        EngineArgs(**flags)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(prefix_caching=False), "--no-prefix-caching"),
        (dict(speculative_method="early_exit"), "speculative_method early_exit"),
        (dict(sliding_window=64), "a sliding window"),
    ],
)
def test_offloading_is_refused_where_a_blocks_kv_is_not_all_in_the_pool(flags, message):
    from llmserve.config import EngineArgs
    from llmserve.model_loader import default_model_path, load_arch_config

    args = EngineArgs(device="cpu", dtype="float32", kv_offloading_size=1, max_model_len=512, **flags)
    with pytest.raises(ValueError, match=message):
        args.create_config(load_arch_config(default_model_path()), "m")
    config = EngineArgs(device="cpu", dtype="float32", kv_offloading_size=0.5).create_config(
        load_arch_config(default_model_path()), "m"
    )
    assert config.cache.kv_offloading.ram_bytes == 1 << 29 and config.cache.kv_offloading.disk_dir is None


def test_a_disk_hit_survives_its_own_allocation_pushing_it_off_the_disk_tier(make_request, tmp_path):
    parent = b""
    for start in (0, 4, 8):
        tokens = tuple(SHARED[start : start + 4])
        parent = hash_block(parent, tokens)
        kv_block_file.write_block(kv_block_file.block_path(tmp_path, parent), KEY, parent, tokens, bytes(64))
    scheduler, kv = make_scheduler(num_blocks=5, ram=1, disk_dir=tmp_path, disk=3)
    run_to_end(scheduler, make_request(17, max_tokens=1))  # four cached blocks wait in the pool
    again = make_request(0, tokens=SHARED + [7])
    scheduler.add_request(again)
    ops = scheduler.schedule().plan.tier_ops
    # the hit's fresh blocks evict two cached ones: RAM takes the first, the second pushes it to the
    # full disk tier, which deletes the hit's own oldest file (already read); the request's new
    # block, allocated after the loads are queued, evicts once more
    expected = ["save", "delete", "demote", "save"] + ["load_bytes"] * 3 + ["delete", "demote", "save"]
    assert [op.kind for op in ops] == expected
    assert again.num_cached_tokens == 12
    kv.check_integrity()


def test_a_hit_with_more_disk_reads_than_the_idle_bound_is_admitted(make_request, tmp_path, monkeypatch):
    parent = b""
    for start in (0, 4):
        tokens = tuple(SHARED[start : start + 4])
        parent = hash_block(parent, tokens)
        kv_block_file.write_block(kv_block_file.block_path(tmp_path, parent), KEY, parent, tokens, bytes(64))
    # the reads finish one by one, each when released; a read started again would wait forever
    gates, read, calls = [threading.Event() for _ in range(3)], kv_block_file.read_block, []

    def gated_read(*args):
        calls.append(args)
        gates[len(calls) - 1].wait(30)
        return read(*args)

    monkeypatch.setattr(kv_block_file, "read_block", gated_read)
    monkeypatch.setattr(kv_tiers, "_MAX_IDLE_READS", 1)  # this hit's two reads are over the bound
    scheduler, kv = make_scheduler(disk_dir=tmp_path, disk=8, read_threads=1)
    request = make_request(0, tokens=SHARED[:8] + [7])
    scheduler.add_request(request)
    assert not scheduler.schedule().requests  # both reads started
    gates[0].set()
    wait_until(lambda: sum(future.done() for future in kv.pool.tiers._reads.values()) == 1)
    assert not scheduler.schedule().requests  # one read done, kept though over the bound
    gates[1].set()
    wait_until(lambda: all(future.done() for future in kv.pool.tiers._reads.values()))
    output = scheduler.schedule()
    assert request in output.requests and request.num_cached_tokens == 8 and len(calls) == 2
    assert [op.kind for op in output.plan.tier_ops] == ["load_bytes"] * 2
    gates[2].set()


def test_a_slot_saved_and_evicted_in_one_step_is_written_once(make_request):
    scheduler, kv = make_scheduler(num_blocks=8, ram=2)
    first = make_request(0, tokens=SHARED + [1], max_tokens=1)
    run_to_end(scheduler, first)  # caches three blocks
    blocks = [
        kv.pool.lookup(h, tuple(SHARED[i * 4 : i * 4 + 4]))
        for i, h in enumerate(kv.prefix_cache.block_hashes(first))
    ]
    ops = fill_pool(scheduler, make_request, 8)  # evicts all three into two slots
    saves = [(op.block, op.slot) for op in ops if op.kind == "save"]
    # the slot of the block evicted first goes to the third before anything reads it: that save is
    # no copy at all (one indexed copy writing a slot twice leaves either block's KV there)
    assert [op.kind for op in ops] == ["save", "save"] and sorted(slot for _, slot in saves) == [0, 1]
    slots = {block_hash: slot for block_hash, (_, slot) in kv.pool.tiers.ram.entries.items()}
    assert sorted(saves) == sorted(
        (blocks[i], slots[h]) for i, h in enumerate(kv.prefix_cache.block_hashes(first)) if h in slots
    )
    assert kv.pool.tiers.counters["ram"].bytes_stored == 2 * BLOCK_BYTES
    kv.check_integrity()
