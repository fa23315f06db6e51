"""`--dtype auto`: bf16 on CPUs that compute it natively or run treepage's bf16 kernels, fp32 elsewhere;
explicit choices pass through."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from treepage import arg_groups
from treepage.arg_groups import (
    choose_cpu_dtype,
    cpu_features,
    dtype_choice,
    parse_cpuinfo_features,
    resolve_dtype,
)
from treepage.layers import cpu_build, cpu_linear
from treepage.server_args import ServerArgs

# The CPU of the issue: AVX-512 (F/BW/VL/VNNI) but no BF16 -- torch reports just "AVX512" for it, as it does for
# a CPU that has AVX512-BF16.
AVX512_NO_BF16 = {"avx512_f": True, "avx512_bw": True, "avx512_vl": True, "avx512_vnni": True, "avx2": True}


@pytest.mark.parametrize(
    "features, dtype, named",
    [
        (AVX512_NO_BF16, torch.float32, None),
        ({**AVX512_NO_BF16, "avx512_bf16": False, "amx_bf16": False}, torch.float32, None),
        ({"avx2": True, "fma3": True}, torch.float32, None),
        ({}, torch.float32, None),
        ({**AVX512_NO_BF16, "avx512_bf16": True}, torch.bfloat16, "avx512_bf16"),
        ({"amx_bf16": True, "amx_tile": True, "avx512_bf16": True}, torch.bfloat16, "amx_bf16"),
        ({"neon": True, "bf16": True}, torch.bfloat16, "bf16"),
        ({"neon": True, "sve": True}, torch.float32, None),
    ],
)
def test_auto_picks_bf16_where_native_or_where_the_kernels_run(features, dtype, named):
    choice = choose_cpu_dtype(features)
    assert choice.dtype == dtype
    if named:
        assert named in choice.reason and "natively" in choice.reason
    else:
        assert "emulated" in choice.reason
    with_kernels = choose_cpu_dtype(features, bf16_kernels=True)
    assert with_kernels.dtype == torch.bfloat16
    assert ("natively" if named else "treepage's bf16 kernels run here") in with_kernels.reason


def test_cpuinfo_flags_are_parsed_per_architecture():
    x86 = "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n"
    assert parse_cpuinfo_features(x86) == {"fpu": True, "avx2": True, "avx512f": True, "avx512_bf16": True,
                                           "amx_tile": True}  # fmt: skip
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"
    assert choose_cpu_dtype(parse_cpuinfo_features(arm)).dtype == torch.bfloat16
    assert parse_cpuinfo_features("processor\t: 0\n") == {}


linux_only = pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads /proc/cpuinfo")


@linux_only
def test_features_fall_back_to_cpuinfo_without_torch_probe(monkeypatch):
    """Older torch has no torch.cpu.get_capabilities: the kernel's flags decide."""
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    flags = set(parse_cpuinfo_features(open("/proc/cpuinfo").read()))
    assert {k for k, v in cpu_features().items() if v} == flags


@linux_only
def test_this_machine_agrees_with_its_flags():
    """torch's probe and /proc/cpuinfo name the same bf16 features on this machine."""
    flags = parse_cpuinfo_features(open("/proc/cpuinfo").read())
    probed = cpu_features()
    for name in ("avx512_bf16", "amx_bf16"):
        if name in probed or name in flags:
            assert bool(probed.get(name)) == bool(flags.get(name)), name


def test_explicit_and_cuda_choices_pass_through():
    assert dtype_choice(ServerArgs(dtype="float"), "cpu").dtype == torch.float32
    assert dtype_choice(ServerArgs(dtype="half"), "cpu").dtype == torch.float16
    assert dtype_choice(ServerArgs(dtype="bfloat16"), "cpu").reason == "--dtype bfloat16"
    assert dtype_choice(ServerArgs(dtype="auto"), "cuda").dtype == torch.bfloat16


def test_resolve_logs_the_choice_and_reason(monkeypatch, caplog):
    monkeypatch.setattr(arg_groups, "cpu_features", lambda: dict(AVX512_NO_BF16))
    monkeypatch.setattr(arg_groups, "bf16_kernels", lambda: False)
    with caplog.at_level("INFO", logger="treepage.arg_groups"):
        assert resolve_dtype(ServerArgs(dtype="auto"), "cpu") == torch.float32
    assert "dtype float32" in caplog.text and "no native bf16" in caplog.text
    monkeypatch.setattr(arg_groups, "bf16_kernels", lambda: True)
    caplog.clear()
    with caplog.at_level("INFO", logger="treepage.arg_groups"):
        assert resolve_dtype(ServerArgs(dtype="auto"), "cpu") == torch.bfloat16
    assert "dtype bfloat16" in caplog.text and "kernels run here" in caplog.text
    # training's matmuls (transformers, autograd) are torch's own, which the kernels do not serve: native only
    assert dtype_choice(ServerArgs(dtype="auto"), "cpu", treepage_kernels=False).dtype == torch.float32


def has_avx2_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as f:
        return {"avx2", "fma"} <= set(parse_cpuinfo_features(f.read()))


@pytest.mark.skipif(
    not has_avx2_fma() or cpu_build._compiler() is None,
    reason="the bf16 kernels need x86 with AVX2 + FMA (read from /proc/cpuinfo) and a C compiler",
)
def test_a_cpu_without_native_bf16_gets_bf16_from_the_kernels():
    """This machine run as one without AVX-512 (ATEN_CPU_CAPABILITY=avx2, a fresh process): the kernels build
    their widening path and auto picks bf16 for it."""
    code = (
        "from treepage.arg_groups import dtype_choice; from treepage.layers import cpu_linear; "
        "from treepage.server_args import ServerArgs; "
        "print(cpu_linear.load().path, dtype_choice(ServerArgs(dtype='auto'), 'cpu').dtype)"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(cpu_linear.PATH_WIDEN), "torch.bfloat16"]


def test_features_beyond_torchs_vector_isa_do_not_count():
    """ATEN_CPU_CAPABILITY=avx2 on a CPU with AVX512-BF16: torch (and the C kernels) use no AVX-512, so the
    CPU counts as one without native bf16."""
    amx_cpu = {**AVX512_NO_BF16, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True}
    assert arg_groups.within_torch_isa(amx_cpu, "AVX512") == amx_cpu
    for capped in ("AVX2", "DEFAULT"):
        assert arg_groups.within_torch_isa(amx_cpu, capped) == {"avx2": True}
        assert choose_cpu_dtype(arg_groups.within_torch_isa(amx_cpu, capped)).dtype == torch.float32
    arm = {"neon": True, "bf16": True}
    assert arg_groups.within_torch_isa(arm, "DEFAULT") == arm  # Arm's capabilities are not x86's
