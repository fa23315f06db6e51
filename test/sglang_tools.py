"""SGLang's own tools as clients of treepage: the gateway (PyPI sglang-router) and bench_serving (PyPI sglang,
installed with --no-deps as a client only)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from server_utils import free_port, log_tail

BENCH_SERVING = Path(__file__).resolve().parents[1] / "scripts" / "sglang_bench_serving.py"


def run_bench_serving(args: list[str], timeout: float = 600.0) -> subprocess.CompletedProcess:
    """`python -m sglang.bench_serving ARGS` through scripts/sglang_bench_serving.py (the one import it needs on a
    client-only install); output captured."""
    cmd = [sys.executable, str(BENCH_SERVING), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@contextmanager
def launch_router(
    worker_urls: list[str], log_path: Path, policy: str = "round_robin", startup_timeout: float = 120.0
) -> Iterator[str]:
    """sglang-router on a free local port in front of the workers; yields its URL once every worker is healthy
    in it, stops it at the end."""
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
           "--policy", policy, "--log-level", "warn"]  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout
        while not _all_workers_healthy(base_url, len(worker_urls)):
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with code {proc.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"router not ready after {startup_timeout:.0f}s:\n{log_tail(log_path)}")
            time.sleep(0.5)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)  # it drains in-flight requests first
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _all_workers_healthy(base_url: str, n: int) -> bool:
    try:
        workers = httpx.get(f"{base_url}/workers", timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return len(workers) == n and all(w["is_healthy"] for w in workers)
