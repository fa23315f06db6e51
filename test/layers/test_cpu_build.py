"""The C kernels' builder (layers/cpu_build.py): the shared headers are part of what a cached build depends
on, and the kernels stay within the vector ISA torch dispatches to."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from treepage.layers import cpu_build

needs_compiler = pytest.mark.skipif(cpu_build._compiler() is None, reason="builds need a C compiler")


@needs_compiler
def test_editing_a_shared_header_rebuilds_the_kernels_that_include_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEPAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "INCLUDE_DIR", tmp_path)
    header, source = tmp_path / "shared.h", tmp_path / "kernel.c"
    source.write_text('#include "shared.h"\nint answer(void) { return ANSWER; }\n')
    cc = cpu_build._compiler()
    assert cc is not None

    def build(answer: int) -> tuple[str, int]:
        header.write_text(f"#define ANSWER {answer}\n")
        out = cpu_build._build(cc, source)
        return out.name, ctypes.CDLL(str(out)).answer()

    first, again, edited = build(1), build(1), build(2)
    assert first == again  # the same source and headers: the cached library
    assert edited[0] != first[0] and edited[1] == 2  # a header edit alone: a new build that sees it


@needs_compiler
def test_both_kernels_build_against_the_shared_header():
    from treepage.layers import cpu_linear
    from treepage.layers.attention import cpu_kernels

    assert (cpu_build.INCLUDE_DIR / "cpu_bf16.h").exists()
    for source in (cpu_linear.SOURCE, cpu_kernels.SOURCE):
        assert '#include "cpu_bf16.h"' in source.read_text()
        assert cpu_build._build(cpu_build._compiler() or "cc", source).exists()


def test_the_isa_cap_follows_torchs_capability():
    amx_cpu = "flags\t: fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n"
    assert cpu_build.isa_cap_flags("AVX512", amx_cpu) == []
    assert cpu_build.isa_cap_flags("AVX2", amx_cpu) == ["-mno-avx512f", "-mno-amx-tile"]
    assert cpu_build.isa_cap_flags("AVX2", "flags\t: fpu avx2 fma avx512f\n") == ["-mno-avx512f"]
    assert cpu_build.isa_cap_flags("DEFAULT", "flags\t: fpu avx2 fma\n") == ["-mno-avx"]


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector ISAs")
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_a_capped_torch_gets_kernels_without_the_isa_above_it(capability, tmp_path, monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (or default) on a CPU with more: the kernels are built without AVX-512 (or
    AVX), as a CPU without it would build them, so their lesser paths run and can be measured here."""
    monkeypatch.setenv("TREEPAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    source = tmp_path / "isa.c"
    source.write_text(
        "int avx512(void) {\n#ifdef __AVX512F__\nreturn 1;\n#else\nreturn 0;\n#endif\n}\n"
        "int avx(void) {\n#ifdef __AVX__\nreturn 1;\n#else\nreturn 0;\n#endif\n}\n"
    )
    cc = cpu_build._compiler()
    assert cc is not None
    lib = ctypes.CDLL(str(cpu_build._build(cc, source)))
    assert lib.avx512() == 0
    assert lib.avx() == (capability == "AVX2")
