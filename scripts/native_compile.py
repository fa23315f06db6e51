"""Compile every Triton kernel variant the engine launches for CUDA targets, on a host without a GPU.

The interpreter runs the kernels' arithmetic on CPU but not the native pipeline (tl.dot shape and dtype rules,
shared-memory use, typing of constexpr branches). triton.compile needs only the toolchain Triton ships, so this
check runs anywhere. The kernels must be imported with TRITON_INTERPRET=0, hence a process of its own:

    TRITON_INTERPRET=0 python scripts/native_compile.py --matrix quick

Constexprs and num_warps come from the launch-parameter functions the wrappers call (native=True). Runtime
arguments are example values that specialise as a real launch does (16-aligned pointers, strides of the model
shapes, integers equal to 1 as constexprs), because that specialisation changes vectorisation and shared memory.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import triton

from treepage.layers.attention.triton_ops import interpreting
from treepage.layers.attention.triton_ops.decode_attention import (
    _decode_partial_kernel,
    _merge_kernel,
    decode_launch_params,
    merge_launch_params,
)
from treepage.layers.attention.triton_ops.extend_attention import _extend_kernel, extend_launch_params
from treepage.speculative.triton_ops.tail_dup import (
    _tail_dup_kernel,
    tail_dup_bits_dtype,
    tail_dup_launch_params,
)

# name -> (compute capability, per-block shared memory with the opt-in attribute, in bytes)
TARGETS = {"sm_90": (90, 232448), "sm_80": (80, 166912)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KERNELS = {
    "decode_partial": _decode_partial_kernel,
    "merge": _merge_kernel,
    "extend": _extend_kernel,
    "tail_dup": _tail_dup_kernel,
}
_TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
}
# per GQA group: an MHA model, SmolLM2-135M (9/3), Llama-3-8B (32/8), Llama-3-70B (64/8)
_KV_HEADS = {1: 32, 3: 3, 4: 8, 8: 8}
# Constexprs that are matrix coordinates of their own (index arithmetic, the mask branch); the rest ("tiles")
# pick dot shapes, layouts, precision and shared memory.
_NOT_TILES = {"QPB", "GROUP", "PAGE", "PAGE_SIZE", "CUSTOM_MASK"}

# Axes of each kernel's matrix. "ints" picks the runtime integers that vary per batch (page-table width,
# split counts, row width, topk): "wide" = multiples of 16 (the most specialised), "ones" = the 1s that
# become constexprs (one page, one split, topk 2) and odd values.
AXES: dict[str, dict[str, tuple]] = {
    "decode_partial": dict(
        dtype=tuple(DTYPES), D=(64, 128, 256), group=(1, 3, 4, 8), qpb=(1, 4, 8), page=(1, 4, 16, 64),
        ints=("wide", "ones"),
    ),
    "extend": dict(
        dtype=tuple(DTYPES), D=(64, 128, 256), group=(1, 3, 4), page=(1, 4, 16, 64), mask=(False, True),
        ints=("wide", "ones"),
    ),
    "merge": dict(dtype=tuple(DTYPES), D=(64, 128), splits=(1, 3, 8, 32, 64)),
    "tail_dup": dict(dtype=tuple(DTYPES), page=(4, 16, 64), slot=(192, 1024), ints=("wide", "ones")),
}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    kernel: str
    spec: tuple[tuple[str, Any], ...]  # matrix coordinates, plus ("tiles", ...) from the launch params
    args: dict[str, Any]  # runtime arguments: a torch dtype stands for a (16-aligned) tensor of that dtype
    params: dict[str, Any]  # constexprs and num_warps, from the kernel's launch-parameter function

    @property
    def label(self) -> str:
        return f"{self.kernel} " + " ".join(f"{k}={v}" for k, v in self.spec if k != "tiles")

    def specialize(self) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list]]:
        """(signature, constexprs, attrs) for ASTSource, by the JIT launcher's rules for these arguments."""
        fn = KERNELS[self.kernel]
        sig: dict[str, str] = {}
        constexprs = {k: v for k, v in self.params.items() if k != "num_warps"}
        attrs: dict[tuple[int, ...], list] = {}
        for i, name in enumerate(fn.arg_names):
            if name in constexprs:
                sig[name] = "constexpr"
                continue
            ty, aligned = jit_type(self.args[name])
            if ty == "constexpr":
                constexprs[name] = self.args[name]
            sig[name] = ty
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        return sig, constexprs, attrs

    def key(self) -> tuple:
        """What is compiled: variants with equal keys compile to the same binary."""
        sig, constexprs, attrs = self.specialize()
        warps = self.params["num_warps"]
        return self.kernel, tuple(sig.items()), tuple(constexprs.items()), tuple(attrs), warps


def jit_type(value: Any) -> tuple[str, bool]:
    """(type, 16-divisible) as Triton's launcher specialises an argument: an int equal to 1 is a constexpr."""
    if isinstance(value, torch.dtype):
        return "*" + _TRITON_TYPES[value], True  # torch allocations are at least 16-byte aligned
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", False
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"no launch type for {value!r}")


def _tiles(params: dict[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in params.items() if k not in _NOT_TILES))


def _decode(dtype: str, D: int, group: int, qpb: int, page: int, ints: str) -> Variant:
    """Plain decode (qpb 1, also the cascade's branch pass) or the cascade's shared pass (qpb = topk)."""
    dt, hkv = DTYPES[dtype], _KV_HEADS[group]
    hq = hkv * group
    # wide: 16 splits per pass (32 in the buffer), 64 table columns; ones: one split per pass, one column
    splits, total, width = (16, 32, 64) if ints == "wide" else (1, 2, 1)
    offset = splits if qpb == 1 and ints == "ones" else 0  # branch pass after the shared pass's splits
    params = decode_launch_params(qpb, group, page, D, dt, native=True)
    args = dict(
        Q=dt, K=dt, V=dt, Table=torch.int32, Lens=torch.int32, PartO=torch.float32, PartLse=torch.float32,
        stride_q0=hq * D, stride_q1=D, stride_k0=hkv * D, stride_k1=D, stride_v0=hkv * D, stride_v1=D,
        stride_table=width, stride_po0=hq * total * D, stride_po1=total * D, stride_po2=D,
        stride_pl0=hq * total, stride_pl1=total, scale_log2=0.18, num_splits=splits, split_offset=offset,
    )  # fmt: skip
    spec = dict(dtype=dtype, D=D, group=group, qpb=qpb, page=page, ints=ints, tiles=_tiles(params))
    return Variant("decode_partial", tuple(spec.items()), args, params)


def _extend(dtype: str, D: int, group: int, page: int, mask: bool, ints: str) -> Variant:
    dt, hkv = DTYPES[dtype], _KV_HEADS[group]
    hq = hkv * group
    params = extend_launch_params(group, page, D, dt, mask, native=True)
    args = dict(
        Q=dt, K=dt, V=dt, O=dt, Table=torch.int32, QoIndptr=torch.int32, PrefixLens=torch.int32,
        Mask=torch.uint8 if mask else torch.int32,  # the launch passes qo_indptr when there is no mask
        MaskIndptr=torch.int32, stride_q0=hq * D, stride_q1=D, stride_k0=hkv * D, stride_k1=D,
        stride_v0=hkv * D, stride_v1=D, stride_o0=hq * D, stride_o1=D,
        stride_table=64 if ints == "wide" else 1, scale_log2=0.18,
    )  # fmt: skip
    spec = dict(dtype=dtype, D=D, group=group, page=page, mask=mask, ints=ints, tiles=_tiles(params))
    return Variant("extend", tuple(spec.items()), args, params)


def _merge(dtype: str, D: int, splits: int) -> Variant:
    hq = 32
    params = merge_launch_params(splits, D)
    args = dict(
        PartO=torch.float32, PartLse=torch.float32, O=DTYPES[dtype],
        stride_po0=hq * splits * D, stride_po1=splits * D, stride_po2=D, stride_pl0=hq * splits,
        stride_pl1=splits, stride_o0=hq * D, stride_o1=D, num_splits=splits,
    )  # fmt: skip
    spec = dict(dtype=dtype, D=D, splits=splits, tiles=_tiles(params))
    return Variant("merge", tuple(spec.items()), args, params)


def _tail_dup(dtype: str, page: int, slot: int, ints: str) -> Variant:
    """slot = kv heads x head_dim: 3 x 64 (SmolLM2-135M), 8 x 128 (Llama-3-8B)."""
    params = tail_dup_launch_params(page, slot)
    # wide: a 2M-slot pool (plane stride reaches int64 at 1024), topk 8; ones: a small pool, topk 2, odd rows
    num_slots, topk, row_width = (1 << 21, 8, 4096) if ints == "wide" else (10000, 2, 4100)
    i64 = torch.int64
    args = dict(
        kv_ptr=tail_dup_bits_dtype(DTYPES[dtype]), r2t_ptr=i64, rows_ptr=i64, prefix_base_ptr=i64,
        last_page_ptr=i64, nnp_ptr=i64, r2t_stride=row_width, plane_stride=num_slots * slot, slot_elems=slot,
        num_branches_m1=topk - 1, num_j_blocks=triton.cdiv(page - 1, params["BLOCK_J"]),
    )  # fmt: skip
    spec = dict(dtype=dtype, page=page, slot=slot, ints=ints, tiles=_tiles(params))
    return Variant("tail_dup", tuple(spec.items()), args, params)


_BUILDERS: dict[str, Callable[..., Variant]] = {
    "decode_partial": _decode,
    "extend": _extend,
    "merge": _merge,
    "tail_dup": _tail_dup,
}


def _features(v: Variant, strength: int) -> set[tuple]:
    """Every combination of `strength` coordinates, tagged by kernel. The tile choice (last in spec) counts as
    one but pairs only with "ints": dtype and D determine it, the others reach it through index arithmetic
    or a mask branch (pairing it with them too would double the slow check, mostly fp32 D=256 compiles)."""
    combos = itertools.combinations(v.spec, strength)
    return {(v.kernel, *c) for c in combos if strength < 2 or c[-1][0] != "tiles" or c[0][0] == "ints"}


def _cover(full: list[Variant], strength: int) -> list[Variant]:
    """Greedy covering array: few variants such that every `strength`-combination of full appears."""
    todo = set().union(*(_features(v, strength) for v in full))
    picked: list[int] = []
    while todo:
        i = max(range(len(full)), key=lambda i: len(_features(full[i], strength) & todo))  # first best wins
        picked.append(i)
        todo -= _features(full[i], strength)
    return [full[i] for i in sorted(picked)]


def variants(matrix: str = "quick", kernels: tuple[str, ...] = tuple(KERNELS)) -> list[Variant]:
    """full: every matrix point, deduplicated by what is compiled (1,346 variants; over an hour for both targets
    on one core); pairwise: every pair of coordinates (76, ~2.5 min); quick: every coordinate value and every
    tile choice (38, ~1.5 min cold)."""
    out: list[Variant] = []
    for kernel in kernels:
        axes = AXES[kernel]
        seen: set[tuple] = set()
        full = []
        for point in itertools.product(*axes.values()):
            v = _BUILDERS[kernel](*point)
            if (key := v.key()) not in seen:
                seen.add(key)
                full.append(v)
        strength = {"quick": 1, "pairwise": 2, "full": 0}[matrix]
        out += _cover(full, strength) if strength else full
    return out


def jit_type_drift(todo: list[Variant]) -> list[str]:
    """Arguments where jit_type disagrees with the installed Triton's own launcher specialisation."""
    from triton._C.libtriton import native_specialize_impl  # private, but the very function launches use
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import MockTensor

    drift = set()
    for v in todo:
        for name, value in v.args.items():
            arg = MockTensor(value) if isinstance(value, torch.dtype) else value
            ty, key = native_specialize_impl(CUDABackend, arg, False, True, True)[:2]
            if (ty, key == "D") != jit_type(value):
                drift.add(f"{v.kernel}.{name}={value!r}: launcher {ty!r}/{key!r}, here {jit_type(value)}")
    return sorted(drift)


def _error_text(e: BaseException | None) -> str:
    """The whole cause chain: Triton wraps the real message (a tl.dot shape rule, say) in call-site errors."""
    parts: list[str] = []
    while e is not None and len(parts) < 8:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = "\n--- caused by ---\n".join(parts)
    return text if len(text) <= 6000 else text[:1500] + "\n[...]\n" + text[-4000:]


def compile_variant(v: Variant, target: str) -> dict[str, Any]:
    """Compile to cubin for `target`; ok only if it compiles and fits the opt-in shared-memory limit."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arch, limit = TARGETS[target]
    sig, constexprs, attrs = v.specialize()
    shared, error = None, None
    t0 = time.perf_counter()
    try:
        src = ASTSource(KERNELS[v.kernel], sig, constexprs, attrs)
        options = {"num_warps": v.params["num_warps"]}
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        assert "cubin" in compiled.asm, "no cubin produced"
        shared = int(compiled.metadata.shared)
        if shared > limit:
            error = f"shared memory {shared} B exceeds the {limit} B per-block limit of {target}"
    except Exception as e:  # a compile failure is a result, not a crash of the check
        error = _error_text(e)
    return dict(
        kernel=v.kernel,
        label=v.label,
        target=target,
        params=v.params,
        ok=error is None,
        error=error,
        shared=shared,
        shared_limit=limit,
        seconds=round(time.perf_counter() - t0, 3),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", choices=("quick", "pairwise", "full"), default="quick")
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, of " + ", ".join(TARGETS))
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated, of " + ", ".join(KERNELS))
    ap.add_argument("--out", help="write the JSON report here (default: stdout)")
    ap.add_argument("--list", action="store_true", help="list the variants, compile nothing")
    ap.add_argument("--jobs", type=int, default=1, help="compile processes (for the full matrix)")
    a = ap.parse_args(argv)
    todo = variants(a.matrix, tuple(a.kernels.split(",")))
    if a.list:
        print("\n".join(v.label for v in todo))
        return 0
    if interpreting() or not isinstance(_decode_partial_kernel, triton.runtime.JITFunction):
        print("the kernels were imported in interpreter mode: run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    # launches run with the default too; the notice about its future change is noise here
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    t0 = time.perf_counter()
    drift = jit_type_drift(todo)
    for line in drift:
        print(f"FAIL specialisation rule drift: {line}", file=sys.stderr)
    jobs = [(v, target) for target in a.targets.split(",") for v in todo]
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else contextlib.nullcontext() as pool:
        results = list((pool.map if pool else map)(compile_variant, *zip(*jobs)))
    for r in results:
        if not r["ok"]:
            print(f"FAIL {r['target']} {r['label']}: {r['error']}", file=sys.stderr)
    report = dict(
        triton=triton.__version__,
        matrix=a.matrix,
        targets=a.targets.split(","),
        seconds=round(time.perf_counter() - t0, 1),
        drift=drift,
        results=results,
    )
    failed = sum(not r["ok"] for r in results) + len(drift)
    for target in report["targets"]:
        mine = [r for r in results if r["target"] == target and r["shared"] is not None]
        top = max(mine, key=lambda r: r["shared"], default=None)
        most = f"max shared {top['shared']} B ({top['label']})" if top else "nothing compiled"
        print(f"{target}: {len(mine)} compiled, {most}", file=sys.stderr)
    print(
        f"triton {triton.__version__}, {a.matrix}: {len(results)} compiles, {failed} failed, {report['seconds']} s",
        file=sys.stderr,
    )
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
