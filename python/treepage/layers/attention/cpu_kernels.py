"""The C paged-attention kernel for CPU (cpu_paged_attention.c): built at first use, loaded with ctypes.

Why C: torch has no op that reads K/V in place through a page table, so the torch path gathers (and widens to
fp32) the whole context of every layer at every step, which costs several times the bytes the attention needs.
The kernel is plain C with OpenMP (the same libgomp torch loaded, so one thread pool); it is compiled once per
source/compiler/CPU into a per-user cache directory, and anything that fails (no compiler, a compile error, an
unsupported dtype) leaves the torch path in charge.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
# Vectorize for this CPU; finite sentinels keep the kernel correct without IEEE inf/NaN semantics being relied on.
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-std=c11"]
ARCH_FLAGS = [["-march=native"], []]  # fall back to the compiler's default target

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


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


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    errors = []
    for arch in ARCH_FLAGS:
        flags = FLAGS + arch
        key = hashlib.sha256(src + repr(flags).encode() + version.encode() + _cpu_signature().encode())
        out = cache_dir() / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        proc = subprocess.run(
            [cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300
        )
        if proc.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent builders each install a complete file
            return out
        os.unlink(tmp)
        errors.append(f"{' '.join(arch) or 'default target'}: {proc.stderr.strip()[-2000:]}")
    raise RuntimeError("compiling the CPU attention kernel failed:\n" + "\n".join(errors))


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) when it cannot be built here."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cc = _compiler()
        if cc is None:
            logger.warning("no C compiler found: CPU attention runs on the torch path (gathered K/V)")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("CPU attention kernel unavailable (%s): the torch path runs instead", e)
            return None
        p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        lib.paged_attention.restype = i32
        lib.paged_attention.argtypes = [
            p, i32, p, p, i32,  # q, q_bf16, k_cache, v_cache, kv_bf16
            p, i64, i32,  # table, table_stride, page_size
            p, p, p,  # q_start, kv_len, full_len
            i32, p, p,  # mask_kind, mask, mask_start
            i32, i32, i32, i32, f32,  # B, Hq, Hkv, D, scale
            p, p, i32,  # out, lse, nthreads
        ]  # fmt: skip
        _lib = lib
        return lib


KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MASK_ALL, MASK_CAUSAL, MASK_TREE = 0, 1, 2


@dataclass
class KernelPlan:
    """One forward's read plan in the kernel's terms, built once and shared by every layer.

    Request b owns query rows [q_start[b], q_start[b+1]) and KV positions [0, kv_len[b]) through table[b];
    positions below full_len[b] are visible to all its queries, the rest (the window) by `mask_kind`.
    """

    table: torch.Tensor  # [B, W] int32
    page_size: int
    q_start: torch.Tensor  # [B+1] int32
    kv_len: torch.Tensor  # [B] int32
    full_len: torch.Tensor  # [B] int32
    mask_kind: int = MASK_ALL
    mask: torch.Tensor | None = None  # flat bool, request b's [n, n] tree at mask_start[b] (MASK_TREE)
    mask_start: torch.Tensor | None = None  # [B] int64
    # Derived once from the fields above, reused by every layer's call (per-call Python work is a visible share of
    # a short-context decode step): the query row count and the plan's arguments to the C function.
    rows: int = field(init=False)
    c_args: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rows = int(self.q_start[-1])
        self.c_args = (
            _ptr(self.table), self.table.stride(0), self.page_size,
            _ptr(self.q_start), _ptr(self.kv_len), _ptr(self.full_len),
            self.mask_kind, _ptr(self.mask), _ptr(self.mask_start), self.kv_len.numel(),
        )  # fmt: skip

    @classmethod
    def build(
        cls,
        table: torch.Tensor,
        page_size: int,
        q_start: torch.Tensor,
        kv_len: torch.Tensor,
        full_len: torch.Tensor,
        mask_kind: int = MASK_ALL,
        mask: torch.Tensor | None = None,
        mask_start: torch.Tensor | None = None,
    ) -> KernelPlan:
        i32 = [t.to(torch.int32).contiguous() for t in (table, q_start, kv_len, full_len)]
        if mask_kind == MASK_TREE:
            assert mask is not None and mask_start is not None
            mask = mask.to(torch.bool).contiguous()
            mask_start = mask_start.to(torch.int64).contiguous()
        return cls(i32[0], page_size, i32[1], i32[2], i32[3], mask_kind, mask, mask_start)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def paged_attention(
    lib: ctypes.CDLL,
    plan: KernelPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [rows, Hq, D]; caches [slots, Hkv, D] of one dtype (fp32 or bf16) -> (out [rows, Hq, D] fp32,
    natural-log LSE [rows, Hq] fp32 or None). Rows with nothing visible get out 0 and LSE -inf."""
    rows, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KERNEL_DTYPES and q.dtype in KERNEL_DTYPES
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2] == D and Hq % Hkv == 0
    # The kernel trusts its indices: a plan for other rows would read out of bounds.
    assert plan.q_start.numel() == plan.kv_len.numel() + 1 and plan.rows == rows
    q = q.contiguous()
    out = torch.empty(rows, Hq, D, dtype=torch.float32)
    lse = torch.empty(rows, Hq, dtype=torch.float32) if with_lse else None
    rc = lib.paged_attention(
        q.data_ptr(), q.dtype == torch.bfloat16, k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.dtype == torch.bfloat16, *plan.c_args, Hq, Hkv, D, scale,
        out.data_ptr(), _ptr(lse), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("the CPU attention kernel could not allocate its scratch")
    return out, lse
