"""benchmark/gpu_all.py --smoke end to end: the one-command GPU run must work before a device is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_all_smoke_writes_e2e_summary(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "python"))
    cmd = [sys.executable, str(ROOT / "benchmark" / "gpu_all.py"), "--out", str(tmp_path), "--smoke"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["summary.json", "summary.md"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    host = summary["env"]  # the host CPU is part of every result, GPU runs included
    assert host["cpu_model"] and host["nproc"] == os.cpu_count() and isinstance(host["cpu_flags"], list)
    stages = {s["name"]: s for s in summary["stages"]}
    assert stages["pytest"]["status"].startswith("skipped")
    assert stages["e2e"]["status"] == "ok"
    rows = stages["e2e"]["detail"]["rows"]
    off = [r for r in rows if r["case"] == "spec_off"]
    on = [r for r in rows if r["case"] != "spec_off"]
    assert {r["batch"] for r in off} == {1, 2} and all(r["tok_per_s"] > 0 for r in off)
    assert len(on) == 4 and all(r["status"] == "ok" for r in on)
    for r in on:
        assert r["spec_version"] > 0 and r["ratio_vs_off"] > 0
        assert r["avg_accept_len"] == 3.0  # the fixed debug acceptance is what the engine reports
        assert r["output_tokens"] == r["batch"] * 16  # ignore_eos: every request runs to max_new_tokens
    assert "spec_off" in (tmp_path / "summary.md").read_text()
