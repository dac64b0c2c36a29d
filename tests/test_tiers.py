"""tests/conftest.py's guard of the fast tier: an unmarked test may not start this project's processes,
and is told to mark itself; other programs (a compiler, git) it may start."""

import multiprocessing
import subprocess
import sys

import pytest

from tests.helpers import wait_until


def test_an_unmarked_test_may_not_start_an_llmserve_command_or_python_child():
    for command in (
        [sys.executable, "-m", "llmserve.cli", "--help"],
        [sys.executable, "-c", "import llmserve"],
        ["llmserve", "serve"],
    ):
        with pytest.raises(
            AssertionError, match=r"starts the command .*: mark it process, server, ray or browser"
        ):
            subprocess.Popen(command)


def test_an_unmarked_test_may_not_start_a_process_running_the_projects_code():
    process = multiprocessing.get_context("spawn").Process(target=wait_until, args=(bool,))
    with pytest.raises(AssertionError, match=r"starts a process running tests\.helpers\.wait_until: mark it"):
        process.start()


def test_other_programs_may_run():
    assert (
        subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout
        == "42\n"
    )


@pytest.mark.process
def test_a_marked_test_may_start_them():
    done = subprocess.run(
        [sys.executable, "-c", "import llmserve"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
