"""tests/helpers.py's deadline poll: it returns what the condition gave, or fails naming what it awaited."""

import pytest

from tests.helpers import wait_until


def test_wait_until_returns_the_first_truthy_value():
    values = iter([0, None, "", 7, 8])
    assert wait_until(lambda: next(values), 5, interval=0) == 7


def test_wait_until_fails_after_its_timeout_naming_what_it_waited_for():
    calls = []
    said = lambda: f"the gate (polled {'more than once' if len(calls) > 1 else 'once'})"
    with pytest.raises(
        AssertionError, match=r"^timed out after 0.1 s waiting for the gate \(polled more than once\)$"
    ):
        wait_until(lambda: calls.append(1), 0.1, said, interval=0.01)
