"""The docs stay references: docs/benchmarks.md keeps to its bound (a re-run replaces a table, it never adds a
section), and every result file a doc cites exists.

A doc cites a result file by a Markdown link whose target lies under a `results/` folder, or by an inline
code span that is only such a path from the repository root (`benchmarks/results/NAME.json`); a span with a
pattern in it (`{a,b}`, `*`, `$`) names several files and is not checked. Result files live in
benchmarks/results/, outside the docs: no doc may point at the old docs/results/.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS_PAGE = REPO / "docs" / "benchmarks.md"
MAX_BENCHMARKS_LINES = 400
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")
PATTERN_CHARACTERS = set("{}*$<>")


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _cited_result_files(doc: Path, text: str) -> list[tuple[str, Path]]:
    """(as written, resolved path) for each result file the text cites."""
    cited = []
    for target in LINK.findall(text):
        path = target.split("#", 1)[0]
        if "results/" in path and "://" not in path:
            cited.append((target, (doc.parent / path).resolve()))
    for span in CODE_SPAN.findall(text):
        if span.startswith("benchmarks/results/") and not PATTERN_CHARACTERS & set(span):
            cited.append((span, REPO / span))
    return cited


def _missing(docs: list[Path]) -> list[str]:
    return [
        f"{doc.relative_to(REPO)}: {written}"
        for doc in docs
        for written, path in _cited_result_files(doc, doc.read_text())
        if not path.exists()
    ]


def test_benchmarks_page_stays_within_its_bound():
    lines = len(BENCHMARKS_PAGE.read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_LINES, (
        f"docs/benchmarks.md has {lines} lines (at most {MAX_BENCHMARKS_LINES}): replace a table's numbers "
        "with the re-run's, and leave the history to git and the result files"
    )


def test_every_cited_result_file_exists():
    missing = _missing(_docs())
    assert not missing, "docs cite result files that do not exist:\n" + "\n".join(missing)


def test_no_doc_points_at_the_old_results_folder():
    stale = [str(doc.relative_to(REPO)) for doc in _docs() if "docs/results" in doc.read_text()]
    assert not stale, f"result files moved to benchmarks/results/; these docs still say docs/results: {stale}"


def test_the_check_finds_a_missing_file():
    doc = REPO / "docs" / "example.md"  # never written: the text is checked as if it were this doc's
    text = (
        "[there](../benchmarks/results/2026-11-25-latency.json), [gone](../benchmarks/results/none.json), "
        "`benchmarks/results/also-gone.json`, `benchmarks/results/2026-11-25-tp{1,2}-latency.json`"
    )
    cited = _cited_result_files(doc, text)
    assert [written for written, path in cited if not path.exists()] == [
        "../benchmarks/results/none.json",
        "benchmarks/results/also-gone.json",
    ]
    assert len(cited) == 3
