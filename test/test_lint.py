"""Lint is part of the suite, so CI (which runs `make test` only) enforces what `make lint` checks.

ruff over the sources, then mypy over the package with the settings of pyproject.toml. mypy keeps its
incremental cache in .mypy_cache/, so only the first run on a machine is slow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_clean() -> None:
    r = _run("ruff", "check", "python", "test", "benchmark", "scripts")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_clean() -> None:
    r = _run("mypy")  # files and strictness come from [tool.mypy] in pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
