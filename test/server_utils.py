"""Run a real `python -m treepage.launch_server` subprocess for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PYTHON_DIR), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_launch_server(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run launch_server to completion (for start-up failures); captures stdout and stderr."""
    cmd = [sys.executable, "-m", "treepage.launch_server", *args]
    return subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=timeout)


def log_tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


@contextmanager
def launch_server(args: list[str], log_path: Path, startup_timeout: float = 120.0) -> Iterator[str]:
    """Start the server on a free local port, wait for /health, yield its base URL, stop it at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "treepage.launch_server", "--host", "127.0.0.1", "--port", str(port), *args]
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}:\n{log_tail(log_path)}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {startup_timeout:.0f}s:\n{log_tail(log_path)}")
            time.sleep(0.5)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def tiny_spec_server_args(model_dir: str, model_name: str, max_total_tokens: int = 8192) -> list[str]:
    """A tree-speculative server (STANDALONE, the model drafting for itself; K 4, S 3, N 8) on a tiny model."""
    return ["--model-path", model_dir, "--served-model-name", model_name, "--dtype", "float32",
            "--page-size", "4", "--max-total-tokens", str(max_total_tokens),
            "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model_dir,
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
            "--speculative-num-draft-tokens", "8"]  # fmt: skip


@contextmanager
def checked_server(args: list[str], log_path: Path, strict: bool = False) -> Iterator[str]:
    """launch_server (with `strict`, under TREEPAGE_STRICT_MEM_CHECK=1); at the end the server is still healthy,
    holds no page, row or lock once its last requests drained (10 s), and logged no traceback or leak."""
    saved = os.environ.get("TREEPAGE_STRICT_MEM_CHECK")
    if strict:
        os.environ["TREEPAGE_STRICT_MEM_CHECK"] = "1"
    try:
        with launch_server(args, log_path) as url:
            yield url
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            deadline = time.monotonic() + 10
            while (mem := httpx.get(f"{url}/debug/memory", timeout=10).json())["used_pages"] or mem["used_rows"]:
                assert time.monotonic() < deadline, f"KV leak or stuck request: {mem}"
                time.sleep(0.05)
            assert mem["locked_pages"] == 0, mem
    finally:
        if strict:
            if saved is None:
                os.environ.pop("TREEPAGE_STRICT_MEM_CHECK", None)
            else:
                os.environ["TREEPAGE_STRICT_MEM_CHECK"] = saved
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text and "MemoryLeakError" not in text, log_tail(log_path, 200)
