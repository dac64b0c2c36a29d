"""The one error type every model-loading failure raises.

The CLI prints it as a one-line error (exit code 2), so messages name the path and the problem on one
line. It subclasses ValueError because a bad model path is bad user input, like any other bad argument.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model at a path cannot be served: missing, corrupt, or of an unsupported kind."""


def describe(error: BaseException) -> str:
    """`error` as one short line, for wrapping library exceptions whose messages span many lines."""
    text = " ".join(str(error).split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
