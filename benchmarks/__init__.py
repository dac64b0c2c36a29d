"""Measurement kept beside the package, not shipped with it: the investigation tools (`tools/`, each run
as `python -m benchmarks.tools.NAME` from the repository root) and the result files the docs cite
(`results/`)."""
