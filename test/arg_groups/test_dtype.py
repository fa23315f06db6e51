"""`--dtype auto`: bf16 only on CPUs that compute it natively, fp32 elsewhere; explicit choices pass through."""

from __future__ import annotations

import os

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
def test_auto_picks_bf16_only_where_native(features, dtype, named):
    choice = choose_cpu_dtype(features)
    assert choice.dtype == dtype
    if named:
        assert named in choice.reason and "natively" in choice.reason
    else:
        assert "emulated" in choice.reason


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
    with caplog.at_level("INFO", logger="treepage.arg_groups"):
        assert resolve_dtype(ServerArgs(dtype="auto"), "cpu") == torch.float32
    assert "dtype float32" in caplog.text and "no native bf16" in caplog.text
