"""A build lock left by a killed kernel build is removed; a fresh one (a build under way) is kept."""

import os
import time

from llmserve.kernels.cpu_ops import remove_stale_lock


def test_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    assert not remove_stale_lock(str(tmp_path))  # no lock at all
    lock = tmp_path / "lock"
    lock.touch()
    assert not remove_stale_lock(str(tmp_path)) and lock.exists()  # a build may be running
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    assert remove_stale_lock(str(tmp_path)) and not lock.exists()
