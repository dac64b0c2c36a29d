"""Maintained measurement tools that are not `llmserve bench` commands (docs/benchmarks.md, "Tools").

Each runs as `python -m benchmarks.tools.NAME`; each has a smoke test in
tests/benchmarks/test_tools.py.
"""
