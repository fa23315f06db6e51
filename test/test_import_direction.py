"""Package dependencies point one way (docs/design.md, "What each package owns"): a module imports only its own
package and packages below it. Every import counts, including ones inside functions and TYPE_CHECKING blocks."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python" / "treepage"

# Top to bottom. Entry points (the CLI modules) may import anything below them.
LAYERS = [
    {"launch_server"},
    {"entrypoints"},
    {"arg_groups"},
    {"managers"},
    {"speculative"},
    {"model_executor"},
    {"models"},
    {"layers"},
    {"mem_cache"},
    {"core", "server_args", "data"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def package_of(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def treepage_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported top-level treepage package) for every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "treepage"]
        for name in names:
            parts = name.split(".")
            if parts[0] == "treepage" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        src = package_of(path)
        if src == "__init__":
            continue
        for line, dst in treepage_imports(path):
            if dst == src:
                continue
            if dst not in RANK or src not in RANK:
                bad.append(f"{path.relative_to(ROOT)}:{line}: package {dst if dst not in RANK else src} has no rank")
            elif RANK[dst] <= RANK[src]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {dst} (same level or above)")
    return bad


def test_every_package_has_a_rank() -> None:
    packages = {package_of(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert packages <= set(RANK), sorted(packages - set(RANK))


def test_imports_point_down() -> None:
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path: pathlib.Path) -> None:
    """The parser sees imports inside functions, so a lazy upward import cannot hide."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from treepage.managers.scheduler import Scheduler\n")
    assert treepage_imports(f) == [(2, "managers")]
    assert RANK["managers"] < RANK["layers"]

