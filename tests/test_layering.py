"""The package's layering, read from the source with ``ast`` (nothing is imported or run).

- ``engine`` never imports ``app`` (nor Qt): arrows point down, ``app -> engine -> ext``.
- Only the kernel-dispatch modules reach the compiled extension directly.
- No import cycle among ``engine``'s module-level imports.
- No test-only code under ``engine/``; the runtime never imports the measurement tools
  (``engine.bench``) nor the offline converter (``engine.convert``).

Imports are told apart by where they run: *top-level* ones when the module is imported (class
bodies and ``try`` blocks included), *function-level* ones when a function first runs (often
deferred on purpose, to break a cycle or to keep torch out of a light import), and *type-only*
ones under ``if TYPE_CHECKING:`` (never run). A cycle among top-level imports can fail at import
time depending on which module is imported first, so it is an error; cycles that need a
function-level import are printed (``pytest -s``) but allowed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
APP = ROOT / "app"

# The modules that may reach the compiled extension (``trellis_ext``) directly: by importing it, by
# building or loading it (``torch.utils.cpp_extension``), or through the loader that returns it
# (``engine.kernels.loader``). This allow-list *is* the kernels package (DESIGN.md:
# ``engine/kernels/`` is the one place that calls the extension); everything else calls kernels
# through it and runs its torch path where a kernel returns None.
EXTENSION_ACCESS = {
    "engine/kernels/": "the kernels package: loads the extension, calls its kernels",
    "engine/commands/build_ext.py": "`python -m engine build-ext`: runs the build ahead of time",
}
EXTENSION_MODULES = ("trellis_ext", "torch.utils.cpp_extension", "engine.kernels.loader")

QT_ROOTS = {"PySide6", "PySide2", "PyQt5", "PyQt6", "shiboken6"}
TEST_ONLY_IMPORTS = ("pytest", "_pytest", "pytestqt", "hypothesis", "unittest.mock")
TEST_ONLY_NAMES = ("testing", "tests", "conftest")
TEST_ONLY_PREFIXES = ("test_", "fake", "mock")
# Who may import the measurement tools: the tools themselves and the CLI's table of verbs.
BENCH_IMPORTERS = ("engine/bench/", "engine/cli.py")
# Who may import the offline converter (engine.convert): itself, the ``convert`` verb, the
# measurement tools, and the synthetic-model writer (it writes the converter's output layout).
# Loading and running a model needs only the format (engine.exl3).
CONVERTER_IMPORTERS = (
    "engine/convert/",
    "engine/commands/convert.py",
    "engine/bench/",
    "engine/loading/synthetic_store.py",
)


@dataclass(frozen=True)
class Import:
    target: str  # the dotted module name as written (resolved when relative)
    names: tuple[str, ...]  # for ``from X import a, b``: the names; else ()
    kind: str  # "top", "function" or "type"
    line: int


@dataclass
class Module:
    name: str
    path: Path
    imports: list[Import]

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package: str) -> Iterator[Import]:
    """Every import in ``tree`` with where it runs; ``package`` resolves relative imports."""

    def visit(node: ast.AST, kind: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(alias.name, (), kind, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                yield Import(base, tuple(a.name for a in child.names), kind, child.lineno)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, "function" if kind == "top" else kind)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "type")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from visit(child, kind)

    yield from visit(tree, "top")


def load_modules(top: Path) -> dict[str, Module]:
    modules = {}
    for path in sorted(top.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules[name] = Module(name, path, list(_imports(tree, package)))
    return modules


ENGINE_MODULES = load_modules(ENGINE)


def targets(imp: Import, known: dict[str, Module]) -> set[str]:
    """The modules an import loads, as named in ``known``: ``from pkg import sub`` is the
    submodule ``pkg.sub`` where one exists, else ``pkg`` itself; ``import a.b.c`` is the longest
    known prefix. Parent packages' ``__init__`` are not counted (Python runs them first, but a
    submodule importing a sibling while its package initialises is no cycle in practice)."""
    found = set()
    for name in imp.names or ("",):
        full = f"{imp.target}.{name}" if name else imp.target
        while full and full not in known:
            full = full.rpartition(".")[0]
        if full:
            found.add(full)
    return found


def imports_module(imp: Import, dotted: str) -> bool:
    """Whether ``imp`` imports ``dotted`` or something inside it (``from torch.utils import
    cpp_extension`` imports ``torch.utils.cpp_extension``)."""
    written = [imp.target] + [f"{imp.target}.{n}" for n in imp.names]
    return any(w == dotted or w.startswith(dotted + ".") for w in written)


def graph(kinds: set[str]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in ENGINE_MODULES}
    for mod in ENGINE_MODULES.values():
        for imp in mod.imports:
            if imp.kind in kinds:
                edges[mod.name] |= targets(imp, ENGINE_MODULES) - {mod.name}
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components of more than one module (sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def a_cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One concrete cycle through the component's first module (breadth-first, so the shortest)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def where(source: str, target: str, kinds: set[str]) -> str:
    """Where ``source`` imports ``target``: ``file:line`` of each such import, with its kind."""
    mod = ENGINE_MODULES[source]
    return ", ".join(
        f"{mod.rel}:{imp.line} {imp.kind}"
        for imp in mod.imports
        if imp.kind in kinds and target in targets(imp, ENGINE_MODULES)
    )


def describe_cycles(kinds: set[str]) -> list[str]:
    """Each strongly connected component as its members and one cycle through it, every step
    with the import that makes it."""
    edges = graph(kinds)
    found = []
    for component in strongly_connected(edges):
        cycle = a_cycle(component, edges)
        steps = [f"{a} -> {b} ({where(a, b, kinds)})" for a, b in zip(cycle, cycle[1:])]
        found.append(f"{{{', '.join(component)}}}: " + "; ".join(steps))
    return found


# ---------------------------------------------------------------------------------------------


def test_the_graph_is_read() -> None:
    # Guards the checks below against passing vacuously (a wrong root, a parser that finds nothing).
    assert {"engine.session", "engine.cli", "engine.bench", "engine.commands.generate"} <= set(ENGINE_MODULES)
    assert "engine.errors" in graph({"top"})["engine.cli"]  # a module-level import
    assert "engine.bench" in graph({"function"})["engine.cli"]  # an import inside build_parser
    top = sum(len(v) for v in graph({"top"}).values())
    deferred = sum(len(v) for v in graph({"function"}).values())
    print(f"\nengine: {len(ENGINE_MODULES)} modules, {top} top-level and {deferred} function-level edges")


def test_engine_never_imports_the_app_or_qt() -> None:
    offenders = [
        f"{mod.rel}:{imp.line} imports {imp.target}"
        for mod in ENGINE_MODULES.values()
        for imp in mod.imports
        if imp.target.split(".")[0] in {"app", *QT_ROOTS}
        or (imp.target == "" and "app" in imp.names)  # defensive: `from . import app` at the root
    ]
    assert not offenders, "engine must not depend on the GUI:\n" + "\n".join(offenders)


def test_only_the_dispatch_modules_reach_the_extension() -> None:
    missing = [path for path in EXTENSION_ACCESS if not (ROOT / path).exists()]
    assert not missing, f"allow-listed but gone (update EXTENSION_ACCESS): {missing}"
    offenders = [
        f"{mod.rel}:{imp.line} imports {imp.target} {list(imp.names) or ''}".rstrip()
        for mod in ENGINE_MODULES.values()
        if not mod.rel.startswith(tuple(EXTENSION_ACCESS))
        for imp in mod.imports
        if any(imports_module(imp, dotted) for dotted in EXTENSION_MODULES)
    ]
    assert not offenders, "call kernels through engine.kernels, not the extension:\n" + "\n".join(offenders)


def test_no_import_cycle_among_top_level_imports() -> None:
    deferred = [c for c in describe_cycles({"top", "function"}) if c not in describe_cycles({"top"})]
    if deferred:
        print("\ncycles that need a function-level (deferred) import, allowed:")
        print("\n".join(f"  {c}" for c in deferred))
    cycles = describe_cycles({"top"})
    assert not cycles, "import cycles among module-level imports:\n" + "\n".join(cycles)


def test_no_test_only_code_in_the_library() -> None:
    named = [
        mod.rel
        for mod in ENGINE_MODULES.values()
        for part in mod.path.relative_to(ENGINE).with_suffix("").parts
        if part in TEST_ONLY_NAMES or part.startswith(TEST_ONLY_PREFIXES)
    ]
    assert not named, f"test-only modules belong in tests/support/: {named}"
    importing = [
        f"{mod.rel}:{imp.line} imports {imp.target}"
        for mod in ENGINE_MODULES.values()
        for imp in mod.imports
        if any(imports_module(imp, dotted) for dotted in TEST_ONLY_IMPORTS)
    ]
    assert not importing, "the library must not import test frameworks:\n" + "\n".join(importing)


@pytest.mark.parametrize("top", [ENGINE, APP], ids=["engine", "app"])
def test_the_runtime_never_imports_the_measurement_tools(top: Path) -> None:
    modules = ENGINE_MODULES if top == ENGINE else load_modules(top)
    offenders = [
        f"{mod.rel}:{imp.line} imports {imp.target}"
        for mod in modules.values()
        if not mod.rel.startswith(BENCH_IMPORTERS)
        for imp in mod.imports
        if imports_module(imp, "engine.bench") or (imp.target == "engine" and "bench" in imp.names)
    ]
    assert not offenders, "engine.bench is for measuring, not for running:\n" + "\n".join(offenders)


@pytest.mark.parametrize("top", [ENGINE, APP], ids=["engine", "app"])
def test_the_runtime_never_imports_the_converter(top: Path) -> None:
    modules = ENGINE_MODULES if top == ENGINE else load_modules(top)
    offenders = [
        f"{mod.rel}:{imp.line} imports {imp.target}"
        for mod in modules.values()
        if not mod.rel.startswith(CONVERTER_IMPORTERS)
        for imp in mod.imports
        if imports_module(imp, "engine.convert") or (imp.target == "engine" and "convert" in imp.names)
    ]
    assert not offenders, "engine.convert is the offline converter, not the runtime:\n" + "\n".join(offenders)
