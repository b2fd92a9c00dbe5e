"""The package's folders and what each may import, as ``docs/contributing.md`` maps them.

- every module's imports, at its top and inside functions alike, stay within what its
  folder may import (:data:`ALLOWED`), and none of ``metrics``, ``checks``,
  ``functional`` or the package's ``__init__`` imports Lightning, TensorBoard or Pillow
  (``views`` draws with Pillow, and only ``loop`` imports Lightning);
- inside ``metrics``, the native kernel is reached through ``backends`` and ``extras``
  alone, and reads only the declarations it is checked against;
- in a fresh process, importing the math, the checks, the views or the one-shot functions
  (and using them) leaves Lightning, TensorBoard and Pillow out of ``sys.modules``; the
  loop's public names are still there, on first use;
- the package map of ``docs/contributing.md`` names every module and gives the same
  matrix;
- no module runs over 450 lines, and only two functions over 60.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_rollout_debug

PACKAGE = Path(lightning_rollout_debug.__file__).resolve().parent
NAME = PACKAGE.name
CONTRIBUTING = Path(__file__).resolve().parents[1] / "docs" / "contributing.md"

FOLDERS = ("metrics", "checks", "views", "loop")
ALLOWED: dict[str, frozenset[str]] = {
    "metrics": frozenset({"metrics"}),
    "checks": frozenset({"metrics", "checks"}),
    "views": frozenset({"metrics", "views"}),
    "loop": frozenset({"metrics", "checks", "views", "loop"}),
    "functional": frozenset({"metrics"}),
    "__init__": frozenset({"metrics", "checks", "loop"}),
}
"""What each part of the package may import of the package: a folder, or a top module."""

LIGHTNING = frozenset({"pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities"})
DRAWING = frozenset({"tensorboard", "tensorboardX", "PIL"})
FORBIDDEN: dict[str, frozenset[str]] = {
    "metrics": LIGHTNING | DRAWING,
    "checks": LIGHTNING | DRAWING,
    "views": LIGHTNING,
    "loop": frozenset(),
    "functional": LIGHTNING | DRAWING,
    "__init__": LIGHTNING | DRAWING,
}
"""The outside packages each part may not import."""

NATIVE_READS = frozenset({"caller", "layout", "profile", "rows", "worst_tokens"})
"""What the kernel's modules import of ``metrics`` besides themselves: the declarations
its loader checks the kernel's names and constants against, and the warnings' caller."""
NATIVE_USERS = frozenset({"backends", "extras"})
"""The modules of ``metrics`` that run the kernel."""


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def dotted(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The part of the package a dotted module name is in: its folder or top module."""
    inside = module.split(".")[1:]
    if not inside:
        return "__init__"
    return inside[0]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, with its line: at the top, in functions, under ``if``.

    ``from package import name`` counts as ``package.name`` where ``name`` is a module of
    the package, so ``from lightning_rollout_debug.metrics import native`` is ``native``.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = dotted(path) if path.name == "__init__.py" else dotted(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = base.startswith(NAME) and (
                    (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").is_file()
                    or (PACKAGE.parent / candidate.replace(".", "/")).is_dir()
                )
                found.append((node.lineno, candidate if is_module else base))
    return found


def test_the_package_has_its_folders_and_front_doors() -> None:
    tops = {path.name for path in PACKAGE.iterdir() if path.suffix == ".py"}
    assert tops == {"__init__.py", "functional.py"}
    folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    assert folders == set(FOLDERS)


@pytest.mark.parametrize("path", modules(), ids=lambda path: dotted(path))
def test_a_module_imports_what_its_folder_may(path: Path) -> None:
    here = part_of(dotted(path))
    wrong = []
    for line, module in imports_of(path):
        top = module.split(".")[0]
        if top == NAME and part_of(module) not in ALLOWED[here]:
            wrong.append(f"line {line}: {module} ({part_of(module)} is not allowed in {here})")
        elif top in FORBIDDEN[here]:
            wrong.append(f"line {line}: {module} (no {top} in {here})")
    assert not wrong, f"{dotted(path)} imports: " + "; ".join(wrong)


@pytest.mark.parametrize("path", modules(), ids=lambda path: dotted(path))
def test_the_kernel_is_reached_through_backends_and_extras(path: Path) -> None:
    name = dotted(path)
    native = f"{NAME}.metrics.native"
    imported = {module for _, module in imports_of(path) if module.startswith(f"{NAME}.metrics")}
    if name.startswith(native):
        others = {m.split(".")[2] for m in imported if not m.startswith(native)}
        assert others <= NATIVE_READS, f"{name} imports {sorted(others - NATIVE_READS)}"
    elif part_of(name) == "metrics" and any(m.startswith(native) for m in imported):
        assert name.split(".")[-1] in NATIVE_USERS, f"{name} imports the kernel"


@pytest.mark.parametrize("path", modules(), ids=lambda path: dotted(path))
def test_every_module_says_what_it_holds(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert docstring, f"{dotted(path)} has no module docstring"


MODULE_LINES_AT_MOST = 450
LONG_FUNCTION_LINES = 60
LONG_FUNCTIONS = frozenset({"response_log_probs", "row_sums"})
"""The functions allowed over :data:`LONG_FUNCTION_LINES` lines: a slicing recipe, the torch
reference of the kernel's row quantities, and a picture's drawing."""


@pytest.mark.parametrize("path", modules(), ids=lambda path: dotted(path))
def test_a_module_holds_at_most_450_lines(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MODULE_LINES_AT_MOST, f"{dotted(path)} has {lines} lines"


def test_only_three_functions_run_over_60_lines() -> None:
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                if length > LONG_FUNCTION_LINES:
                    long[f"{dotted(path)}.{node.name}"] = length
    assert {name.rsplit(".", 1)[1] for name in long} <= LONG_FUNCTIONS, long
    assert len(long) <= len(LONG_FUNCTIONS), long


QUIET_IMPORTS = """
import sys
import torch
import lightning_rollout_debug
import lightning_rollout_debug.metrics
import lightning_rollout_debug.metrics.native
import lightning_rollout_debug.checks.alerts
import lightning_rollout_debug.checks.diagnosis
import lightning_rollout_debug.checks.drift
from lightning_rollout_debug import MismatchStats
from lightning_rollout_debug.functional import (
    calculate_debug_metrics, mismatch_metrics, mismatch_profile,
)
rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
batch = (rollout, rollout - 0.01, torch.tensor([[1, 1, 0]]))
stats = MismatchStats()
stats.update(*batch)
assert stats.compute()["rollout_tokens"] == 2.0
assert mismatch_metrics(*batch)["training/rollout_tokens"] == 2.0
assert mismatch_profile(*batch)["quantiles"]
keys = ("rollout_log_probs", "old_log_probs", "response_mask")
assert calculate_debug_metrics(dict(zip(keys, batch)))["training/rollout_probs_diff_valid"] == 1
print(sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[1:])))
"""

VIEW_IMPORTS = """
import sys
import lightning_rollout_debug.views.tensorboard
print(sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[1:])))
"""


def imported_in_a_fresh_process(code: str, watched: frozenset[str]) -> list[str]:
    path = os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code, *sorted(watched)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return list(ast.literal_eval(done.stdout.strip().splitlines()[-1]))


def test_the_math_and_the_functions_run_without_lightning_tensorboard_or_pillow() -> None:
    assert imported_in_a_fresh_process(QUIET_IMPORTS, LIGHTNING | DRAWING) == []


def test_the_views_draw_without_lightning() -> None:
    assert imported_in_a_fresh_process(VIEW_IMPORTS, LIGHTNING) == []


def test_every_public_name_is_there_the_loop_on_first_use() -> None:
    for name in lightning_rollout_debug.__all__:
        value = getattr(lightning_rollout_debug, name)
        assert value is not None
        assert name in dir(lightning_rollout_debug)
    assert lightning_rollout_debug.RolloutDebugCallback.__module__ == f"{NAME}.loop.callback"
    with pytest.raises(AttributeError, match="no attribute 'RolloutDebugCallbak'"):
        _ = lightning_rollout_debug.RolloutDebugCallbak  # type: ignore[attr-defined]


def test_the_package_map_names_every_module() -> None:
    text = CONTRIBUTING.read_text(encoding="utf-8")
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, re.M))
    folder_inits = {f"{folder}/__init__.py" for folder in FOLDERS}
    present = {path.relative_to(PACKAGE).as_posix() for path in modules()} - folder_inits
    assert sorted(present - named) == [], "modules missing from docs/contributing.md"
    assert sorted(named - present) == [], "docs/contributing.md names modules that are gone"


def test_the_package_map_gives_the_matrix_the_tests_enforce() -> None:
    text = CONTRIBUTING.read_text(encoding="utf-8")
    table = text[text.index("| part | may import of the package |") :]
    table = table[: table.index("\n\n")]
    documented = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        part = cells[0].strip("`").removesuffix("/").removesuffix(".py")
        documented[part] = frozenset(re.findall(r"`(\w+)`", cells[1]))
    assert documented == ALLOWED
