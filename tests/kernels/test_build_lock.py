"""A lock file left by a killed kernel build is removed; one whose build is under way is kept."""

import threading

from llmserve.kernels.cpu_ops import build_lock


def test_a_killed_builds_lock_is_removed_and_a_running_builds_kept(tmp_path):
    with build_lock(str(tmp_path)) as removed:
        assert not removed  # no lock at all
    lock = tmp_path / "lock"
    lock.touch()  # torch's lock file, its builder gone (no one holds the flock)
    with build_lock(str(tmp_path)) as removed:
        assert removed and not lock.exists()

    # a live build: it holds the flock and torch's lock file; a second loader waits, then finds
    # the file gone (the builder removed it when it finished) rather than removing it under it
    seen = []
    with build_lock(str(tmp_path)):
        lock.touch()
        waiter = threading.Thread(target=lambda: seen.append(_take(tmp_path)))
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive() and lock.exists()  # blocked behind the build
        lock.unlink()  # torch removes its lock when the build ends
    waiter.join(timeout=10)
    assert seen == [False]


def _take(path) -> bool:
    with build_lock(str(path)) as removed:
        return removed
