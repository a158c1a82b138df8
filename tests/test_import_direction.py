"""Imports between the project's packages run one way, and the library never imports Kedro.

Read off the source (every ``import``/``from`` statement, lazy ones inside functions too),
so a function-level import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "titan_kedro"
LIBRARY = ("config", "components", "data", "models", "train", "plan", "launch", "tracking", "ft")


def _imports(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in SRC.rglob("*.py"):
        package = path.relative_to(SRC).parts[0].removesuffix(".py")
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == "titan_kedro" and len(parts) > 1 and parts[1] != package:
                graph[package].add(parts[1])
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_packages_import_each_other_one_way() -> None:
    graph = _package_graph()
    assert graph["train"] >= {"models", "components"}, graph["train"]  # the graph was read
    assert _find_cycle(graph) is None, f"import cycle between packages: {_find_cycle(graph)}"


def test_config_and_models_sit_below_training() -> None:
    graph = _package_graph()
    assert graph["config"] <= set(), f"config imports {sorted(graph['config'])}"
    assert graph["models"] <= {"config", "components"}, sorted(graph["models"])
    assert graph["components"] <= {"config"}, sorted(graph["components"])


def test_library_code_never_imports_kedro() -> None:
    offenders = sorted(
        str(path.relative_to(SRC))
        for package in LIBRARY
        for path in (SRC / package).rglob("*.py")
        if any(m == "kedro" or m.startswith(("kedro.", "kedro_")) for m in _imports(path))
    )
    assert offenders == [], f"library modules importing Kedro: {offenders}"
