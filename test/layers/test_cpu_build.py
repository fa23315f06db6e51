"""The C kernels' builder (layers/cpu_build.py): the shared headers are part of what a cached build depends on."""

from __future__ import annotations

import ctypes

import pytest

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
