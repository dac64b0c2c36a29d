"""No import cycles among llmserve's packages.

A node is a subpackage of ``llmserve`` (``llmserve.core``, ``llmserve.spec_decode``, ...) or a
top-level module (``llmserve.config``, ``llmserve.request``, ...); the package itself
(``llmserve/__init__.py``) is left out, as it only re-exports. Every import in every ``.py``
file under ``llmserve`` counts, wherever it stands: at module level, inside a function, or under
``if TYPE_CHECKING``. An import deferred into a function still makes its package depend on the
other one; deferring it only hides the cycle from the interpreter, not from the reader. For the
same reason ``from llmserve import LLM`` counts as importing the module that defines ``LLM`` (the
package's lazy ``_EXPORTS``), and ``importlib.import_module("llmserve....")`` with a literal name
counts as an import.

An edge ``a -> b`` means some module of ``a`` imports some module of ``b``. The test finds the
strongly connected components of that graph and fails on any with more than one node, naming
one cycle through it and the files whose imports make each of its edges.
"""

import ast
from collections import defaultdict
from pathlib import Path

import llmserve

ROOT = Path(llmserve.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _lazy_exports() -> dict[str, str]:
    """llmserve/__init__.py's `_EXPORTS`: public name -> the module `from llmserve import name` loads."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every llmserve module `path` imports, relative imports resolved; names
    taken from the package itself count as their modules, and so do importlib.import_module("...")
    and __import__("...") calls with a literal name."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    exports = _lazy_exports()
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            # `from llmserve import config` imports the module llmserve.config.
            found.update(f"{base}.{alias.name}" for alias in node.names)
            if base == "llmserve":  # `from llmserve import LLM`: the module that defines it
                found.update(exports[alias.name] for alias in node.names if alias.name in exports)
        elif isinstance(node, ast.Call) and _dynamic_import_name(node) is not None:
            found.add(_dynamic_import_name(node))
    return {name for name in found if name.startswith("llmserve.")}


def _dynamic_import_name(call: ast.Call) -> str | None:
    """The literal module name of an importlib.import_module("...") or __import__("...") call."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _node(module: str) -> str | None:
    """The graph node a module belongs to: llmserve.<first component>, or None for llmserve."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def import_graph() -> dict[str, dict[str, set[str]]]:
    """node -> imported node -> the files (relative to llmserve/) whose imports make that edge."""
    known = {_module_name(p) for p in ROOT.rglob("*.py")}
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(ROOT.rglob("*.py")):
        src = _node(_module_name(path))
        for imported in _imported_modules(path):
            # `from llmserve.x import name` names an attribute, not a module, unless it is one.
            if imported not in known and imported.rpartition(".")[0] in known:
                imported = imported.rpartition(".")[0]
            dst = _node(imported)
            if src and dst and dst != src:
                graph[src][dst].add(str(path.relative_to(ROOT)))
    return graph


def strongly_connected(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Tarjan's algorithm; components in reverse topological order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    nodes = set(graph) | {w for edges in graph.values() for w in edges}
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return components


def _cycle_through(graph: dict[str, dict[str, set[str]]], component: list[str]) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle found in {component}")


def _describe(graph: dict[str, dict[str, set[str]]], component: list[str]) -> str:
    cycle = _cycle_through(graph, component)
    lines = [f"{' -> '.join(cycle)}  (component: {', '.join(component)})"]
    for a, b in zip(cycle, cycle[1:], strict=False):
        lines.append(f"  {a} -> {b}: {', '.join(sorted(graph[a][b]))}")
    return "\n".join(lines)


def test_no_import_cycles_between_packages():
    graph = import_graph()
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles between llmserve's packages:\n" + "\n".join(
        _describe(graph, c) for c in cycles
    )


def test_the_walk_sees_known_edges():
    """The walk finds imports at every level, so a pass is not an empty graph passing."""
    graph = import_graph()
    assert "llmserve.core" in graph["llmserve.engine"]  # module level
    assert sum(len(edges) for edges in graph.values()) > 30
