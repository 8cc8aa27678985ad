"""Imports in agent/ point down the layers docs/architecture.md lists, and form no cycle:
every `import` and `from ... import` counts, at module level, inside functions and under
`if TYPE_CHECKING:` alike, since each is a dependency one way."""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

AGENT = Path(__file__).resolve().parent.parent / "agent"
ARCHITECTURE = AGENT.parent / "docs" / "architecture.md"


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `line` of `path`."""

    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path.name}:{self.line})"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool,
             known: dict[str, Path]) -> set[str]:
    """The modules of `known` that executing `node` inside `source` makes it depend on.

    Importing `a.b.c` runs the __init__ of `a` and `a.b` first, so those count too, except the
    packages `source` itself lies in: Python initialises them before `source`, by construction.
    `from a.b import x` depends on `a.b.x` when that is a module, else on `a.b`'s __init__."""
    own = set(_ancestors(source)) | {source}
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            found |= {*_ancestors(alias.name), alias.name}
        return {m for m in found if m in known} - own
    if node.level:
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    found = {*_ancestors(pkg), pkg} - own
    for alias in node.names:
        sub = f"{pkg}.{alias.name}"
        # An attribute of a package's __init__ is a dependency on that __init__, even when the
        # importer lives inside the package (it needs the attribute defined by then).
        found.add(sub if sub in known else pkg)
    return {m for m in found if m in known} - {source}


def import_graph(root: Path) -> dict[str, list[Edge]]:
    """Each module of the package at `root` and the imports of it that stay inside it."""
    known = modules(root)
    graph: dict[str, list[Edge]] = {}
    for name, path in known.items():
        edges: dict[str, Edge] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, name, path.name == "__init__.py", known):
                    edges.setdefault(target, Edge(name, target, path, node.lineno))
        graph[name] = sorted(edges.values(), key=lambda e: e.target)
    return graph


def _strongly_connected(graph: dict[str, list[Edge]]) -> Iterator[set[str]]:
    """Tarjan's components of more than one module, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(graph[edge.target])))
                elif edge.target in on_stack:
                    low[node] = min(low[node], index[edge.target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    yield component


def _shortest_cycle(graph: dict[str, list[Edge]], component: set[str]) -> list[Edge]:
    """One shortest cycle through the component's first module (breadth first)."""
    start = min(component)
    paths: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target == start:
                    return paths[node] + [edge]
                if edge.target in component and edge.target not in paths:
                    paths[edge.target] = paths[node] + [edge]
                    nxt.append(edge.target)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is strongly connected but has no cycle")


def cycles(root: Path) -> list[str]:
    """One import cycle per set of modules of the package at `root` that import each other,
    and the rest of the set when it is larger than that cycle (it holds more cycles)."""
    graph = import_graph(root)
    found = []
    for component in _strongly_connected(graph):
        cycle = _shortest_cycle(graph, component)
        line = " -> ".join([cycle[0].source]
                           + [f"{e.target} ({e.path.name}:{e.line})" for e in cycle])
        rest = component - {e.target for e in cycle}
        if rest:
            line += f"; also in cycles with these: {', '.join(sorted(rest))}"
        found.append(line)
    return sorted(found)


def read_layers(doc: Path) -> list[tuple[str, list[str]]]:
    """The layers of the table under "## Layers" in `doc`, lowest first: each its name and
    its modules, dotted: a package's whole tree ends in '.' (`agent/holder/` ->
    'agent.holder.'), a module is itself (`agent/proc.py` -> 'agent.proc',
    `agent/__init__.py` -> 'agent')."""
    section = doc.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for row in re.findall(r"^\| *(\d+)\. *([^|]+?) *\|([^|]+)\|", section, re.M):
        paths = re.findall(r"`(agent/[^`]*)`", row[2])
        layers.append((row[1], [_dotted(p) for p in paths]))
    return layers


def _dotted(path: str) -> str:
    if path.endswith("/"):
        return path.removesuffix("/").replace("/", ".") + "."
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The index of the layer that names `module`, or the longest package holding it."""
    best, found = -1, None
    for i, (_, names) in enumerate(layers):
        for n in names:
            held = module + "." == n or module.startswith(n) if n.endswith(".") else module == n
            if held and len(n) > best:
                best, found = len(n), i
    return found


def layer_violations(root: Path, layers: list[tuple[str, list[str]]]) -> list[str]:
    """Every import in the package at `root` of a module in a higher layer than the
    importer's, and every module that is in no layer. A package whose __init__ imports
    nothing of the package is no dependency of its own (only its modules are)."""
    graph = import_graph(root)
    paths = modules(root)
    empty = {m for m, edges in graph.items() if not edges and paths[m].name == "__init__.py"}
    found = [f"{m} is in no layer of docs/architecture.md" for m in graph
             if _layer_of(m, layers) is None]
    for source, edges in graph.items():
        here = _layer_of(source, layers)
        for e in edges:
            there = _layer_of(e.target, layers)
            if here is None or there is None or there <= here or e.target in empty:
                continue
            found.append(f"{e}: {layers[here][0]} imports {layers[there][0]}, a layer above it")
    return found


def test_imports_point_down_the_layers_of_the_architecture_page():
    layers = read_layers(ARCHITECTURE)
    assert len(layers) >= 5, f"no layer table under '## Layers' in {ARCHITECTURE}"
    found = layer_violations(AGENT, layers)
    assert found == [], ("imports against the layers of docs/architecture.md (move the "
                         "module, or what both need, to the lower layer):\n" + "\n".join(found))


def test_an_import_of_a_higher_layer_is_named_with_its_line(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from pkg.high import b\n",
        "pkg/high.py": "from pkg.low import a\n",
        "pkg/stray.py": "",
    })
    layers = [("low", ["pkg.low.", "pkg", "pkg.stray"]), ("high", ["pkg.high"])]
    assert layer_violations(root, layers) == [
        "pkg.low.a -> pkg.high (a.py:2): low imports high, a layer above it"]
    # A module only its package's name would cover is in no layer: new modules are placed.
    assert layer_violations(root, [("low", ["pkg"]), ("high", ["pkg.high"])]) == [
        "pkg.low is in no layer of docs/architecture.md",
        "pkg.low.a is in no layer of docs/architecture.md",
        "pkg.stray is in no layer of docs/architecture.md"]


def test_the_layer_table_is_read_lowest_first_with_each_path_as_a_module_prefix(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# A\n\n## Layers\n\n| layer | modules |\n| --- | --- |\n"
                   "| 1. base | `agent/errors.py`, `agent/__init__.py` |\n"
                   "| 2. holder | `agent/holder/` |\n\n## Next\n| 3. no | `agent/x.py` |\n")
    assert read_layers(doc) == [("base", ["agent.errors", "agent"]),
                                ("holder", ["agent.holder."])]


def test_agent_has_no_import_cycles():
    found = cycles(AGENT)
    assert found == [], ("import cycles in agent/ (move what both sides need into a module "
                         "that imports neither):\n" + "\n".join(found))


def test_the_walk_sees_every_agent_module_and_its_imports():
    graph = import_graph(AGENT)
    assert {"agent.cli", "agent.run", "agent.engines.vllm.adapter"} <= graph.keys()
    assert "agent.config" in {e.target for e in graph["agent.run"]}


def _package(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(textwrap.dedent(text))
    return tmp / "pkg"


def test_a_cycle_through_a_function_level_import_is_named_with_its_lines(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def thing():\n    from pkg import a\n",
    })
    assert cycles(root) == ["pkg.a -> pkg.b (a.py:1) -> pkg.a (b.py:2)"]


def test_a_cycle_through_a_type_checking_import_counts(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n",
        "pkg/b.py": "from . import a\n",
    })
    assert cycles(root) == ["pkg.a -> pkg.b (a.py:3) -> pkg.a (b.py:1)"]


def test_a_larger_tangle_names_one_cycle_and_every_other_module_in_it(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "import pkg.a\nimport pkg.c\n",
        "pkg/c.py": "import pkg.b\n",
        "pkg/d.py": "import pkg.a\n",
    })
    assert cycles(root) == ["pkg.a -> pkg.b (a.py:1) -> pkg.a (b.py:1); "
                            "also in cycles with these: pkg.c"]


def test_importing_a_submodule_runs_its_package_init_which_may_close_a_cycle(tmp_path):
    # identity -> engines.base runs engines/__init__, whose factory imports the adapter, which
    # imports identity: the shape of the cycle agent/ once had.
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/identity.py": "from pkg.engines.base import Spec\n",
        "pkg/engines/__init__.py": "def build():\n    from pkg.engines.adapter import A\n",
        "pkg/engines/base.py": "class Spec: ...\n",
        "pkg/engines/adapter.py": "from pkg.identity import x\n",
    })
    assert cycles(root) == [
        "pkg.engines -> pkg.engines.adapter (__init__.py:2) -> pkg.identity (adapter.py:1) "
        "-> pkg.engines (identity.py:1)"]


def test_a_package_init_importing_its_own_modules_is_no_cycle(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.sub.b import B\n",
        "pkg/sub/__init__.py": "from .b import B\n",
        "pkg/sub/b.py": "from pkg.sub import c\nfrom . import c as again\n",
        "pkg/sub/c.py": "import pkg.sub.d\n",
        "pkg/sub/d.py": "",
    })
    assert cycles(root) == []


def test_a_module_needing_an_attribute_of_its_own_package_init_depends_on_it(tmp_path):
    # backends/__init__ builds cpu lazily; cpu takes a class defined in that __init__.
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/backends/__init__.py": "class Err(Exception): ...\n"
                                    "def build():\n    from pkg.backends.cpu import Cpu\n",
        "pkg/backends/cpu.py": "from pkg.backends import Err\n",
    })
    assert cycles(root) == ["pkg.backends -> pkg.backends.cpu (__init__.py:3) "
                            "-> pkg.backends (cpu.py:1)"]
