"""The layer rule (docs/architecture.md): every module sits on a floor, and
imports only from its own floor or below, with no circle between the units.

Read from the source with ``ast``, so an import that is only under ``if
TYPE_CHECKING:`` or inside a function counts as much as one at the top. A
new module must be given a floor here (and in docs/architecture.md) before it
can land: an unplaced module fails the test.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.modules_kit import module_files

# (unit, floor): a unit is a module or a package with everything under it;
# the longest matching unit places a module.
FLOORS: dict[str, int] = {
    # 0 base: imports nothing of the project
    "kernel.errors": 0,
    "kernel._checks": 0,
    "kernel._lazy": 0,
    "kernel._providers": 0,
    "kernel._version": 0,
    "kernel.tracing": 0,
    "kernel.terminal": 0,
    # 1 mechanism: confinement, workers, the workspace (only kernel.errors, kernel.terminal, kernel._checks)
    "sandbox": 1,
    # 2 records: messages, tools and their schemas, the home and its config
    "kernel.messages": 2,
    "kernel.tools": 2,
    "kernel.home": 2,
    "kernel.settings": 2,
    # 3 services: stores, model adapters, the executor, the plugin authoring API
    "kernel.store": 3,
    "kernel.models": 3,
    "kernel.executor": 3,
    "kernel.plugin": 3,
    # 4 plugins: the host, the worker's entry point, the built-in plugins
    "plugins": 4,
    # 5 agent: sessions, history, the agent loop, test doubles
    "kernel.session": 5,
    "kernel.history": 5,
    "kernel.agent": 5,
    "kernel.testing": 5,
    # 6 assembly: the Kernel that wires the floors below together
    "kernel.kernel": 6,
    "kernel.demo": 6,
    "kernel.batch": 6,
    # 7 front doors: the WebSocket wire, the MCP server, the REPL, the CLI
    "kernel.wire": 7,
    "kernel.repl": 7,
    "kernel.mcp": 7,
    "kernel.cli": 7,
}
# Lazy re-exports of the public names (by string, on first use): above every
# floor, so no module imports it (the front doors take __version__ from kernel._version).
EXEMPT = {"kernel"}


def modules() -> dict[str, Path]:
    return module_files()


def unit_of(module: str) -> str | None:
    best = None
    for unit in FLOORS:
        if (module == unit or module.startswith(unit + ".")) and (
            best is None or len(unit) > len(best)
        ):
            best = unit
    return best


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """The project modules ``module`` imports, with the line of each import."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known(alias.name, known, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule`
                if f"{target}.{alias.name}" in known:
                    yield f"{target}.{alias.name}", node.lineno
            yield from _known(target, known, node.lineno)


def _known(name: str, known: set[str], line: int) -> Iterator[tuple[str, int]]:
    while name and name not in known:
        name = name.rpartition(".")[0]
    if name:
        yield name, line


def graph() -> tuple[dict[str, list[tuple[str, int]]], list[str]]:
    found = modules()
    known = set(found)
    edges = {m: list(imports_of(m, p, known)) for m, p in found.items()}
    unplaced = [m for m in found if m not in EXEMPT and unit_of(m) is None]
    return edges, unplaced


def test_every_module_has_a_floor() -> None:
    _, unplaced = graph()
    assert not unplaced, f"modules without a floor (add them to FLOORS): {unplaced}"


def test_no_module_imports_from_a_floor_above_it() -> None:
    edges, _ = graph()
    upward = []
    for module, targets in edges.items():
        unit = unit_of(module)
        if module in EXEMPT or unit is None:
            continue
        for target, line in targets:
            target_unit = unit_of(target)
            if target in EXEMPT:  # above every floor: no module imports it
                upward.append(f"{module}:{line} imports the package's public face {target}")
            elif target_unit is not None and FLOORS[target_unit] > FLOORS[unit]:
                upward.append(
                    f"{module}:{line} (floor {FLOORS[unit]}) imports {target} "
                    f"(floor {FLOORS[target_unit]})"
                )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_sandbox_imports_nothing_of_the_kernel_but_its_errors_terminal_text_and_checks() -> None:
    edges, _ = graph()
    bad = [
        f"{module}:{line} imports {target}"
        for module, targets in edges.items()
        if unit_of(module) == "sandbox"
        for target, line in targets
        if unit_of(target) != "sandbox"
        and target not in {"kernel.errors", "kernel.terminal", "kernel._checks"}
    ]
    assert not bad, "\n".join(bad)


def test_no_circle_between_units() -> None:
    edges, _ = graph()
    unit_edges: dict[str, set[str]] = {u: set() for u in FLOORS}
    for module, targets in edges.items():
        unit = unit_of(module)
        if unit is None:
            continue
        for target, _ in targets:
            target_unit = unit_of(target)
            if target_unit is not None and target_unit != unit:
                unit_edges[unit].add(target_unit)
    circles = _circles(unit_edges)
    assert not circles, "import circles between units: " + "; ".join(
        " -> ".join(c) for c in circles
    )


def test_no_circle_between_the_modules_of_a_package() -> None:
    """Inside a package, no two modules import each other, directly or round about (a
    command's parser and its body did: ``kernel.cli.batch`` <-> ``kernel.cli._batch``).
    The package's ``__init__`` is left out: it re-exports its modules by design."""
    found = modules()
    edges, _ = graph()
    packages = {m for m, p in found.items() if p.name == "__init__.py"}
    circles = []
    for package in sorted(packages):
        members = [m for m in found if m.rpartition(".")[0] == package and m not in packages]
        inside = {m: {t for t, _ in edges[m] if t in members and t != m} for m in members}
        circles += _circles(inside)
    assert not circles, "import circles inside a package: " + "; ".join(
        " <-> ".join(c) for c in circles
    )


#: A module of ``kernel.cli`` parses, calls the library and prints; past this many
#: lines, domain logic has crept in (``cli/_batch.py`` held 1,092: the run's settings,
#: a second reader of run directories, the progress view).
MAX_COMMAND_LINES = 550


def test_every_command_module_is_small() -> None:
    big = {
        module: lines
        for module, path in modules().items()
        if module.startswith("kernel.cli")
        and (lines := len(path.read_text().splitlines())) > MAX_COMMAND_LINES
    }
    assert not big, f"command modules over {MAX_COMMAND_LINES} lines: {big}"


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule's own test: a floor-1 module importing a floor-7 one is caught."""
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from kernel.cli import main\n")
    found = list(imports_of("sandbox.mod", path, {"kernel.cli", "sandbox.mod"}))
    assert found == [("kernel.cli", 2)]
    assert FLOORS[unit_of("kernel.cli") or ""] > FLOORS[unit_of("sandbox.mod") or ""]
    assert _circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
