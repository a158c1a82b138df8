"""No module in src/ grows past 400 lines; the trainer's and the planner's central
functions stay short enough to read (a new capability gets its own module or helper)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "titan_kedro"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
SHORT_FUNCTIONS = {
    ("train/trainer.py", "Trainer.__init__"),
    ("plan/planner.py", "_measure"),
}
"""(module, qualified name) of functions held under ``MAX_FUNCTION_LINES`` lines."""


def _function_lines(source: str) -> dict[str, int]:
    """Lines of every top-level function and method, by qualified name (decorators excluded)."""
    found: dict[str, int] = {}
    for node in ast.parse(source).body:
        scope = [node] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else []
        prefix = ""
        if isinstance(node, ast.ClassDef):
            scope, prefix = list(node.body), f"{node.name}."
        for function in scope:
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (function.end_lineno or function.lineno) - function.lineno + 1
                found[prefix + function.name] = length
    return found


def test_function_lengths_are_read_off_a_planted_module() -> None:
    source = "class A:\n    def f(self):\n        x = 1\n        return x\n\ndef g():\n    pass\n"
    assert _function_lines(source) == {"A.f": 3, "g": 2}


def test_no_module_in_src_is_over_400_lines() -> None:
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text(encoding="utf-8").splitlines())
        for path in SRC.rglob("*.py")
    }
    assert len(sizes) > 50, "the modules were read"
    over = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert over == {}, f"split these modules (at most {MAX_MODULE_LINES} lines): {over}"


def test_the_trainer_init_and_the_planner_measure_are_under_60_lines() -> None:
    for module, name in sorted(SHORT_FUNCTIONS):
        lines = _function_lines((SRC / module).read_text(encoding="utf-8"))
        assert name in lines, f"{module} has no {name}: update SHORT_FUNCTIONS"
        assert lines[name] < MAX_FUNCTION_LINES, (
            f"{module}: {name} is {lines[name]} lines; move parts into named helpers "
            f"(under {MAX_FUNCTION_LINES})"
        )
