"""The C kernels for CPU (attention/cpu_paged_attention.c, cpu_linear_bf16.c, cpu_rope.c): built at first use, loaded
with ctypes.

Each source is compiled once per source/headers/flags/compiler/CPU into a per-user cache directory with the
system C compiler and OpenMP (the same libgomp torch loaded, so one thread pool). The kernels use no vector
ISA beyond the one torch dispatches to: `ATEN_CPU_CAPABILITY=avx2` on an AVX-512 CPU builds their AVX2 paths,
which is how a CPU without AVX-512 or native bf16 is measured on one that has them
(docs/benchmarks_context.md). The kernels share helpers in this directory's headers (cpu_bf16.h), whose bytes
are part of every kernel's cache key: editing one rebuilds them all. Anything that fails (no compiler, a
compile error) returns None and leaves the caller's torch path in charge, logged once per kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Vectorize for this CPU; finite sentinels keep the kernels correct without IEEE inf/NaN semantics being relied on.
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-std=c11"]
NATIVE = ["-march=native"]  # then the compiler's default target, if that fails
INCLUDE_DIR = Path(__file__).parent  # the headers the kernels share

_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}  # per source: the library, or None once it could not be built


def cache_dir() -> Path:
    base = os.environ.get("TREEPAGE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "treepage"
    )
    return Path(base) / "kernels"


def _cpu_signature() -> str:
    """-march=native binds the binary to this CPU: the CPU's model and flags are part of the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return ""


def isa_cap_flags(capability: str, cpu_flags: str) -> list[str]:
    """Flags that keep -march=native within torch's dispatch `capability` on x86 ("AVX512", "AVX2",
    "DEFAULT"); `cpu_flags` is /proc/cpuinfo's text (AMX, which gcc keeps apart from AVX-512, is switched off
    where present)."""
    amx = ["-mno-amx-tile"] if "amx_tile" in cpu_flags else []
    if capability == "AVX2":
        return ["-mno-avx512f", *amx]
    if capability == "DEFAULT":
        return ["-mno-avx", *amx]  # AVX2, FMA and AVX-512 depend on AVX
    return []


def arch_flags() -> list[list[str]]:
    """-march=native within torch's ISA (isa_cap_flags), then the compiler's default target."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [NATIVE, []]
    caps = isa_cap_flags(torch.backends.cpu.get_cpu_capability(), _cpu_signature())
    return [NATIVE + caps, []]


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def include_flags() -> list[str]:
    return ["-I", str(INCLUDE_DIR)]


def _build(cc: str, source: Path) -> Path:
    src = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h")))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    errors = []
    for arch in arch_flags():
        flags = FLAGS + arch
        key = hashlib.sha256(src + repr(flags).encode() + version.encode() + _cpu_signature().encode())
        out = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        proc = subprocess.run(
            [cc, *flags, *include_flags(), str(source), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent builders each install a complete file
            return out
        os.unlink(tmp)
        errors.append(f"{' '.join(arch) or 'default target'}: {proc.stderr.strip()[-2000:]}")
    raise RuntimeError(f"compiling {source.name} failed:\n" + "\n".join(errors))


def load_kernel(source: Path, declare: Callable[[ctypes.CDLL], None], fallback: str) -> ctypes.CDLL | None:
    """The library built from `source` with its functions' ctypes signatures set by `declare`, or None (logged
    once, saying that `fallback` runs instead) when it cannot be built here."""
    with _lock:
        if source in _loaded:
            return _loaded[source]
        _loaded[source] = None
        cc = _compiler()
        if cc is None:
            logger.warning("no C compiler found for %s: %s runs instead", source.name, fallback)
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc, source)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("%s unavailable (%s): %s runs instead", source.name, e, fallback)
            return None
        declare(lib)
        _loaded[source] = lib
        return lib
