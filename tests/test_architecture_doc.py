"""docs/architecture.md cites code that exists.

Every backticked `path/file.py:Name` or `path/file.py:Class.method` on the page (paths from the repository
root) must name a file that exists and, in it, a top-level function, class or assignment `Name`, or a
class `Class` whose body defines `method` (a method, a nested function or class, or an attribute
assignment); a backticked path with a folder (`core/scheduler.py`) must exist from the repository
root or from llmserve/. The files are parsed with `ast`, never imported: the test needs no model and no torch.
"""

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
REFERENCE = re.compile(r"`([\w./-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`")
FILE_PATH = re.compile(r"`([\w.-]+/[\w./-]+\.(?:py|cpp|h|md))`")  # from the repository root or llmserve/
MIN_HOPS = 10


def _page() -> str:
    return PAGE.read_text()


def _references(text: str) -> list[tuple[str, str]]:
    return REFERENCE.findall(text)


@cache
def _module(path: str) -> ast.Module | None:
    file = REPO / path
    return ast.parse(file.read_text(), str(file)) if file.is_file() else None


def _names_defined(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Name -> the statement defining it, for the defs, classes and assignments of one body."""
    defined: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined[node.name] = node
        elif isinstance(node, ast.Assign):
            defined.update((target.id, node) for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined[node.target.id] = node
    return defined


def _resolves(path: str, dotted: str) -> bool:
    module = _module(path)
    if module is None:
        return False
    body: list[ast.stmt] = module.body
    parts = dotted.split(".")
    for index, part in enumerate(parts):
        node = _names_defined(body).get(part)
        if node is None:
            return False
        if index < len(parts) - 1:
            if not isinstance(node, ast.ClassDef):
                return False
            body = node.body
    return True


def _request_path_hops(text: str) -> list[str]:
    """The numbered items of the section "A request's path"."""
    section = text.split("## A request's path", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. .*$", section, flags=re.MULTILINE)


def test_every_cited_function_exists():
    references = _references(_page())
    missing = sorted(
        {f"{path}:{name}" for path, name in references if not _resolves(path, name)},
    )
    assert not missing, "docs/architecture.md cites code that does not exist:\n" + "\n".join(missing)


def test_every_cited_path_exists():
    paths = set(FILE_PATH.findall(_page()))
    missing = sorted(p for p in paths if not (REPO / p).is_file() and not (REPO / "llmserve" / p).is_file())
    assert not missing, "docs/architecture.md cites files that do not exist:\n" + "\n".join(missing)


def test_request_path_names_a_function_at_every_hop():
    hops = _request_path_hops(_page())
    assert len(hops) >= MIN_HOPS, f'only {len(hops)} hops in "A request\'s path"'
    without = [hop for hop in hops if not _references(hop)]
    assert not without, "hops that cite no file:function:\n" + "\n".join(without)


def test_the_checker_rejects_what_does_not_exist():
    assert _resolves("tests/test_architecture_doc.py", "_resolves")
    assert not _resolves("tests/test_architecture_doc.py", "no_such_function")
    assert not _resolves("tests/test_architecture_doc.py", "_resolves.inner")  # not a class
    assert not _resolves("tests/no_such_file.py", "main")
    text = "`a/b.py:C.m` and `a/b.py` and `x:y` and `a/b.py:f`"
    assert _references(text) == [("a/b.py", "C.m"), ("a/b.py", "f")]
