"""Every Triton kernel variant the engine launches compiles natively for sm_90 and sm_80 and fits shared memory.

test_triton_ops.py and test_tail_dup.py check numerics under the interpreter, which never runs the native
pipeline (tl.dot rules, shared memory, constexpr-branch typing). native_compile compiles to cubin on the CPU; it
runs in a subprocess because the kernels must be imported with TRITON_INTERPRET=0 (this process set it to 1).
On 2 CPU cores with a cold Triton cache: quick ~100 s, pairwise (slow) ~150 s; with a warm cache, seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import native_compile
import pytest
from native_compile import KERNELS, TARGETS, variants


def run_matrix(matrix: str, out: Path, timeout: float) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, native_compile.__file__, "--matrix", matrix, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def check_report(report: dict, matrix: str) -> None:
    results = report["results"]
    assert not report["drift"], "jit_type no longer matches Triton's launcher:\n" + "\n".join(report["drift"])
    failed = [f"{r['target']} {r['label']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(results)} variants failed:\n" + "\n".join(failed)
    assert len(results) == len(variants(matrix)) * len(TARGETS)
    assert {(r["kernel"], r["target"]) for r in results} == {(k, t) for k in KERNELS for t in TARGETS}
    assert all(0 <= r["shared"] <= r["shared_limit"] for r in results)


def test_quick_matrix_covers_every_coordinate_and_tile_choice():
    """The default check sees every value of every axis and every distinct tile/warps/precision choice."""
    full, quick = variants("full"), variants("quick")
    assert len(quick) < len(full) // 10
    for kernel in KERNELS:
        assert {c for v in full if v.kernel == kernel for c in v.spec} == {
            c for v in quick if v.kernel == kernel for c in v.spec
        }
    # the tile branches of the launch-parameter functions, as the matrix must reach them
    extend = [v.params for v in quick if v.kernel == "extend"]
    extend_tiles = {(p["BLOCK_M"], p["BLOCK_N"], p["num_warps"]) for p in extend}
    assert {(64, 64, 4), (64, 64, 8), (32, 32, 4)} <= extend_tiles
    assert {v.params["PREC"] for v in quick if v.kernel in ("extend", "decode_partial")} == {"ieee", "tf32"}
    assert not any(v.params.get("UPCAST") for v in quick)  # native launches never upcast


def test_quick_matrix_compiles(tmp_path):
    check_report(run_matrix("quick", tmp_path / "quick.json", timeout=600), "quick")


@pytest.mark.slow
def test_pairwise_matrix_compiles(tmp_path):
    """Every pair of coordinates (dtype x page size, GQA group x topk, tile choice x mask, ...) at least once."""
    check_report(run_matrix("pairwise", tmp_path / "pairwise.json", timeout=850), "pairwise")
