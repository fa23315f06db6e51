"""Lint is part of the suite, so CI (which runs `make test` only) enforces what `make lint` checks.

ruff over the sources, then mypy over the package with the settings of pyproject.toml. mypy keeps its
incremental cache in .mypy_cache/, so only the first run on a machine is slow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {r.returncode}:\n{r.stdout}{r.stderr}", pytrace=False)


def test_ruff_clean() -> None:
    _check("ruff", "check", "python", "test", "benchmark", "scripts")


def test_mypy_clean() -> None:
    _check("mypy")  # files and strictness come from [tool.mypy] in pyproject.toml
