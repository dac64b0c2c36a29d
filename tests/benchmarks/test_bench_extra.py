"""The `bench` extra (aiohttp, matplotlib, psutil) stays optional: no llmserve module imports it at
module level, and a benchmark that needs a missing one stops with one line naming the extra."""

import ast
import sys
from pathlib import Path

import pytest

import llmserve
from llmserve.benchmarks import results

BENCH_ONLY = {"aiohttp", "matplotlib", "psutil"}
PACKAGE = Path(llmserve.__file__).parent


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def _module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level package names imported by a module's own body (not inside functions or classes, not
    under `if TYPE_CHECKING`), including imports inside module-level try and if blocks."""
    found: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.If | ast.Try | ast.With) and not _type_checking_block(node):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return found


def test_no_llmserve_module_imports_a_bench_dependency_at_module_level():
    offenders = {
        str(path.relative_to(PACKAGE.parent)): sorted(imported & BENCH_ONLY)
        for path in sorted(PACKAGE.rglob("*.py"))
        if (imported := _module_level_imports(ast.parse(path.read_text(), str(path)))) & BENCH_ONLY
    }
    assert not offenders, f"import these inside the function that needs them (bench_dependency): {offenders}"


def test_the_checker_sees_a_module_level_import():
    tree = ast.parse("import os\ntry:\n    import psutil\nexcept ImportError:\n    pass\n")
    assert _module_level_imports(tree) == {"os", "psutil"}
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import aiohttp\n")
    assert _module_level_imports(guarded) == {"typing"}


@pytest.mark.parametrize("name", sorted(BENCH_ONLY))
def test_a_missing_dependency_stops_with_one_line_naming_the_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    with pytest.raises(SystemExit) as stopped:
        results.bench_dependency(name)
    message = str(stopped.value)
    assert "\n" not in message and name in message and "llmserve[bench]" in message


def test_an_installed_dependency_is_returned():
    assert results.bench_dependency("json").dumps([1]) == "[1]"
