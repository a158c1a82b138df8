"""Imports between the project's packages run one way, and the library never imports Kedro.

Read off the source (every ``import``/``from`` statement, lazy ones inside functions too),
so a function-level import cannot hide a cycle between packages. Inside the project,
modules must not import each other in a circle at module level either (the statements
that run on import: not inside functions, not under ``if TYPE_CHECKING``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "titan_kedro"
LIBRARY = (
    "config",
    "components",
    "data",
    "models",
    "runs",
    "storage",
    "train",
    "plan",
    "launch",
    "tracking",
    "ft",
)


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


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported (branches and ``try`` included)."""
    for node in body:
        if isinstance(node, ast.If):
            test = node.test
            type_checking = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            )
            if not type_checking:
                yield from _top_level_statements(node.body)
            yield from _top_level_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _top_level_statements(block)
        elif isinstance(node, ast.With):
            yield from _top_level_statements(node.body)
        else:
            yield node


def _module_graph(root: Path, *, lazy: bool = False) -> dict[str, set[str]]:
    """Module → the project modules it imports (``root`` is the package).

    Only the imports that run on import, unless ``lazy`` (then function-level ones too).
    """
    paths = {_module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree) if lazy else _top_level_statements(tree.body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                # `from package import module` imports the module; other names are attributes.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    for alias in node.names
                ]
            else:
                continue
            graph[name].update(t for t in targets if t in paths and t != name)
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


def test_the_module_graph_finds_a_planted_module_level_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nfrom .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "try:\n    from ..a import X\nexcept ImportError:\n    pass\n"
    )
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
        "def f():\n    import pkg.a\n"
    )
    graph = _module_graph(package)
    assert graph["pkg.c"] == set()  # lazy and type-checking imports do not run on import
    assert _module_graph(package, lazy=True)["pkg.c"] == {"pkg.a"}
    assert _find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import X\n")
    assert _find_cycle(_module_graph(package)) is None


def test_modules_do_not_import_each_other_in_a_circle() -> None:
    graph = _module_graph(SRC)
    assert "titan_kedro.models.spec" in graph["titan_kedro.models.registry"]  # the graph was read
    cycle = _find_cycle(graph)
    assert cycle is None, f"module-level import cycle: {' -> '.join(cycle or [])}"


def test_the_registry_and_the_model_packages_share_only_the_spec_module() -> None:
    graph = _module_graph(SRC, lazy=True)  # the registry finds built-ins by name instead
    registry, spec = "titan_kedro.models.registry", "titan_kedro.models.spec"
    packages = {"titan_kedro.models.llama3", "titan_kedro.models.deepseek_v2"}
    assert not graph[registry] & packages, sorted(graph[registry])
    for package in packages:
        assert spec in graph[package] and registry not in graph[package], sorted(graph[package])
    assert not graph[spec] & {registry, *packages}, sorted(graph[spec])


def test_packages_import_each_other_one_way() -> None:
    graph = _package_graph()
    assert graph["train"] >= {"models", "components"}, graph["train"]  # the graph was read
    assert _find_cycle(graph) is None, f"import cycle between packages: {_find_cycle(graph)}"


def test_config_and_models_sit_below_training() -> None:
    graph = _package_graph()
    assert graph["config"] <= set(), f"config imports {sorted(graph['config'])}"
    assert graph["models"] <= {"config", "components", "storage"}, sorted(graph["models"])
    assert graph["components"] <= {"config"}, sorted(graph["components"])


def test_library_code_never_imports_kedro() -> None:
    offenders = sorted(
        str(path.relative_to(SRC))
        for package in LIBRARY
        for path in (SRC / package).rglob("*.py")
        if any(m == "kedro" or m.startswith(("kedro.", "kedro_")) for m in _imports(path))
    )
    assert offenders == [], f"library modules importing Kedro: {offenders}"


def test_launching_sits_above_training() -> None:
    graph = _package_graph()
    assert graph["launch"] >= {"config"}, graph["launch"]  # the graph was read
    assert "launch" not in graph["train"], "train/ imports launch/: launching belongs above it"
    assert graph["pipelines"] >= {"launch"}, graph["pipelines"]


def test_runs_sit_below_training_and_launching() -> None:
    graph = _package_graph()
    assert "runs" in graph["train"] and "runs" in graph["launch"], "the graph was read"
    above = {"train", "launch", "plan", "pipelines", "hooks"}
    assert not graph["runs"] & above, f"runs/ imports {sorted(graph['runs'] & above)}"


def test_storage_sits_below_data_runs_and_training() -> None:
    graph = _package_graph()
    assert "storage" in graph["runs"], "the graph was read: runs/ opens checkpoints through it"
    assert graph["storage"] <= set(), f"storage/ imports {sorted(graph['storage'])}"
