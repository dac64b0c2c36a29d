"""The text corpus that ships with the interpreter: the Python language reference topics plus the
docstrings of common stdlib modules. Real text (realistic vocabulary, realistic tokens per character)
on any machine without a download: the benchmarks cut their prompts from it
(benchmarks/workload.py), quantization calibrates on it (quantization/calibration.py), and draft-head
training leaves these modules out of its documents (spec_decode/head_training.py), so the benchmarks
measure the head on text it was not trained on.
"""

from __future__ import annotations

import importlib
import inspect
from functools import cache

# Stdlib modules whose docstrings join the language reference in the corpus (fixed, sorted order).
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "dataclasses", "datetime", "email", "functools",
    "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "re", "sqlite3",
    "subprocess", "threading", "typing", "unittest", "urllib.request", "zipfile",
)  # fmt: skip


@cache
def corpus_text() -> str:
    """The Python language reference topics plus docstrings of common stdlib modules."""
    from pydoc_data.topics import topics

    parts = [topics[key] for key in sorted(topics)]
    for name in CORPUS_MODULES:
        parts.extend(_module_docs(name))
    return "\n\n".join(part for part in parts if part)


def _module_docs(name: str) -> list[str]:
    module = importlib.import_module(name)
    docs = [inspect.getdoc(module) or ""]
    for attr in sorted(getattr(module, "__all__", None) or dir(module)):
        member = getattr(module, attr, None)
        if not attr.startswith("_") and (inspect.isclass(member) or inspect.isfunction(member)):
            docs.append(inspect.getdoc(member) or "")
    return docs
