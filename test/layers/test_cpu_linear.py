"""The bf16 few-row linear kernel (layers/cpu_linear_bf16.c) and the widened matmul beside it
(layers/cpu_linear.py): where they run, what they compute, who calls them."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_utils import runner_logits
from treepage.entrypoints.engine import Engine
from treepage.layers import cpu_build, cpu_linear
from treepage.layers.linear import Linear, linear
from treepage.server_args import ServerArgs

BF16 = torch.bfloat16


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for ln in f if ln.startswith("flags") for w in ln.split(":", 1)[1].split()}
    except OSError:
        return set()


X86 = platform.machine() in ("x86_64", "AMD64")
HAS_CC = cpu_build._compiler() is not None
# As the kernels are built here: within the vector ISA torch dispatches to (cpu_build.py)
AVX512_USED = torch.backends.cpu.get_cpu_capability() == "AVX512"
HAS_NATIVE_BF16 = X86 and AVX512_USED and {"avx512_bf16", "avx512bw"} <= cpu_flags()
HAS_AMX = HAS_NATIVE_BF16 and {"amx_bf16", "amx_tile"} <= cpu_flags()
HAS_AVX2_FMA = X86 and {"avx2", "fma"} <= cpu_flags()
needs_native = pytest.mark.skipif(
    not HAS_NATIVE_BF16 or not HAS_CC, reason="the kernel computes in bf16 only with AVX512-BF16"
)
needs_amx = pytest.mark.skipif(not HAS_AMX or not HAS_CC, reason="the kernel's AMX path needs AMX-BF16")
needs_avx2 = pytest.mark.skipif(not HAS_AVX2_FMA or not HAS_CC, reason="the widening path needs AVX2 + FMA")


def build(cache: Path, capability: str) -> ctypes.CDLL:
    """The kernel as cpu_build builds it while torch dispatches to `capability`: what a lesser CPU gets."""
    cc = cpu_build._compiler()
    assert cc is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREEPAGE_CACHE_DIR", str(cache))
        mp.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        lib = ctypes.CDLL(str(cpu_build._build(cc, cpu_linear.SOURCE)))
    cpu_linear._declare(lib)
    return lib


@pytest.fixture(scope="module")
def widen_kernel(tmp_path_factory) -> cpu_linear.Kernel:
    """The build a CPU with AVX2 and without AVX512-BF16 gets (torch's AVX2 capability, as cpu_build caps
    it)."""
    lib = build(tmp_path_factory.mktemp("widen"), "AVX2")
    assert lib.linear_bf16_path() == cpu_linear.PATH_WIDEN
    return cpu_linear.Kernel(lib, cpu_linear.PATH_WIDEN, amx=False)


@pytest.fixture
def emulated(widen_kernel, monkeypatch) -> cpu_linear.Kernel:
    """This process as on a CPU without native bf16: the widening build is the kernel `linear` calls."""
    monkeypatch.setattr(cpu_linear, "_kernel", widen_kernel)
    monkeypatch.setattr(cpu_linear, "_asked", True)
    return widen_kernel


def test_the_kernels_path_follows_the_cpu():
    """VDPBF16PS (and AMX) where the CPU has AVX512-BF16, fp32 FMAs on widened bf16 where it has AVX2 + FMA
    only, nothing (torch's matmul keeps every shape) without a compiler or AVX2."""
    kernel = cpu_linear.load()
    if not HAS_CC or not HAS_AVX2_FMA:
        assert kernel is None and not cpu_linear.bf16_emulated()
        return
    assert kernel is not None
    assert kernel.path == (cpu_linear.PATH_DPBF16 if HAS_NATIVE_BF16 else cpu_linear.PATH_WIDEN)
    assert kernel.amx == HAS_AMX
    assert cpu_linear.bf16_emulated() == (not HAS_NATIVE_BF16)
    assert cpu_linear.serves(torch.randn(2, 8, dtype=BF16), torch.randn(4, 8, dtype=BF16), None)
    tiled = torch.randn(32, 64, dtype=BF16)  # a shape the AMX path takes: more rows served there
    expect = (
        cpu_linear.AMX_MAX_ROWS if HAS_AMX
        else cpu_linear.DPBF16_MAX_ROWS if HAS_NATIVE_BF16
        else cpu_linear.WIDEN_MAX_ROWS
    )  # fmt: skip
    assert cpu_linear.max_rows(tiled) == expect


def test_row_limits_follow_the_path_and_the_kind_of_cpu():
    """On an AMX CPU the AMX path's shapes get its limit and the others the VDPBF16PS path's short one (torch's
    matmul runs on AMX for them); without AMX every shape gets the VDPBF16PS path's longer limit; without
    AVX512-BF16 the widening path's."""
    dp = cpu_linear.PATH_DPBF16
    with_amx = cpu_linear.Kernel(None, dp, True)  # type: ignore[arg-type]
    without_amx = cpu_linear.Kernel(None, dp, False)  # type: ignore[arg-type]
    widen = cpu_linear.Kernel(None, cpu_linear.PATH_WIDEN, False)  # type: ignore[arg-type]
    assert with_amx.max_rows(64, 64) == cpu_linear.AMX_MAX_ROWS
    assert with_amx.max_rows(60, 64) == with_amx.max_rows(64, 48) == cpu_linear.DPBF16_MAX_ROWS_BESIDE_AMX
    assert without_amx.max_rows(64, 64) == without_amx.max_rows(60, 48) == cpu_linear.DPBF16_MAX_ROWS
    assert widen.max_rows(64, 64) == widen.max_rows(60, 48) == cpu_linear.WIDEN_MAX_ROWS
    assert cpu_linear.DPBF16_MAX_ROWS_BESIDE_AMX < cpu_linear.DPBF16_MAX_ROWS < cpu_linear.AMX_MAX_ROWS


@pytest.mark.skipif(not X86 or not HAS_CC, reason="builds for x86")
def test_a_build_without_avx2_is_declared_and_says_so(tmp_path):
    """What a CPU without AVX2 gets (built here with the instructions switched off): a library whose only
    function says it does not compute, which cpu_linear declares without looking for the others."""
    lib = build(tmp_path, "DEFAULT")
    assert lib.linear_bf16_path() == 0
    with pytest.raises(AttributeError):
        lib.linear_bf16  # noqa: B018


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result in fp64 and a bound for fp32 accumulation plus the one bf16 rounding."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return exact, exact.abs() * 2.0**-8 + scale * x.shape[-1] * 2.0**-23


# Both bf16 paths of the kernel: this CPU's VDPBF16PS build, and the widening build a CPU without AVX512-BF16
# gets
PATHS = [pytest.param("native", marks=needs_native), pytest.param("widen", marks=needs_avx2)]


def kernel_for(path: str, request) -> cpu_linear.Kernel | None:
    """None: the kernel cpu_linear loads for this CPU."""
    return request.getfixturevalue("widen_kernel") if path == "widen" else None


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 16])
@pytest.mark.parametrize("N,K", [(1, 1), (7, 31), (9, 32), (13, 33), (5, 100), (576, 1536), (1539, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_exact_product(path, rows, N, K, bias, request):
    kernel = kernel_for(path, request)
    torch.manual_seed(N * 1000 + K + rows)
    x, w = torch.randn(rows, K, dtype=BF16), torch.randn(N, K, dtype=BF16)
    b = torch.randn(N, dtype=BF16) if bias else None
    y = cpu_linear.linear_bf16(x, w, b, kernel)
    assert y.dtype == BF16 and y.shape == (rows, N)
    exact, tol = reference(x, w, b)
    assert ((y.double() - exact).abs() <= tol).all()


@pytest.mark.parametrize("path", PATHS)
def test_kernel_rounds_once_to_nearest_even(path, request):
    """Small integers make every fp32 sum exact, so the result must be exactly the fp32 sum rounded to bf16."""
    kernel = kernel_for(path, request)
    torch.manual_seed(0)
    K = 64 + 17  # a full 32-wide block and a tail
    x = torch.randint(-8, 9, (2, K)).to(BF16)
    w = torch.randint(-8, 9, (11, K)).to(BF16) * 2.0**-3
    b = torch.full((11,), 200.0, dtype=BF16) + torch.arange(11).to(BF16)
    y = cpu_linear.linear_bf16(x, w, b, kernel)
    exact32 = (x.double() @ w.double().T + b.double()).float()  # exact: integers and eighths below 2^24
    assert torch.equal(y, exact32.to(BF16))
    # 257 and 259 are ties between bf16 neighbours (256, 258, 260): round to even gives 256 and 260
    one = torch.ones(1, 1, dtype=BF16)
    for value, expect in ((257.0, 256.0), (259.0, 260.0)):
        y = cpu_linear.linear_bf16(
            one, torch.tensor([[256.0]], dtype=BF16), torch.tensor([value - 256], dtype=BF16), kernel
        )
        assert y.item() == expect


@pytest.mark.parametrize("rows", [1, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_matmul_rounds_the_fp32_sum_once(rows, bias, monkeypatch):
    """`widened` whole and in blocks of output columns (smaller than the weight here): within one bf16
    rounding of the exact product, leading dimensions kept, a block boundary not visible in the result."""
    torch.manual_seed(rows)
    x, w = torch.randn(2, rows, 96, dtype=BF16), torch.randn(131, 96, dtype=BF16)
    b = torch.randn(131, dtype=BF16) if bias else None
    exact, tol = reference(x, w, b)
    whole = cpu_linear.widened(x, w, b)
    assert whole.dtype == BF16 and whole.shape == (2, rows, 131)
    assert ((whole.double() - exact).abs() <= tol).all()
    monkeypatch.setattr(cpu_linear, "WIDEN_BLOCK", 96 * 40)  # blocks of 40 columns, the last one of 11
    assert torch.equal(cpu_linear.widened(x, w, b), whole)


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 17, 24, 32])
@pytest.mark.parametrize("N,K", [(16, 32), (48, 64), (960, 576), (576, 1536), (4096, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_path_matches_the_exact_product(rows, N, K, bias):
    torch.manual_seed(rows * 7 + N + K)
    x, w = torch.randn(rows, K, dtype=BF16), torch.randn(N, K, dtype=BF16)
    b = torch.randn(N, dtype=BF16) if bias else None
    assert cpu_linear.serves(x, w, b) == (rows <= cpu_linear.AMX_MAX_ROWS)  # 32: what the tiles hold, not served
    exact, tol = reference(x, w, b)
    assert ((cpu_linear.linear_bf16(x, w, b).double() - exact).abs() <= tol).all()


@needs_amx
def test_amx_path_leaves_torch_matmuls_correct():
    """The kernel loads its own tile configuration and releases the tiles: torch's bf16 matmuls (oneDNN, on
    AMX as well) in the same threads, before and after, keep their results."""
    torch.manual_seed(3)
    x_big, w_big = torch.randn(64, 576, dtype=BF16), torch.randn(960, 576, dtype=BF16)
    x_few = torch.randn(4, 576, dtype=BF16)
    exact_big, tol_big = reference(x_big, w_big, None)
    exact_few, tol_few = reference(x_few, w_big, None)
    for _ in range(3):
        assert ((F.linear(x_big, w_big).double() - exact_big).abs() <= tol_big).all()
        assert ((cpu_linear.linear_bf16(x_few, w_big, None).double() - exact_few).abs() <= tol_few).all()


@needs_native
def test_batched_leading_dims_and_a_non_contiguous_input():
    torch.manual_seed(1)
    w = torch.randn(40, 64, dtype=BF16)
    x = torch.randn(64, 2, dtype=BF16).T  # [2, 64], not contiguous
    y = linear(x, w)
    exact, tol = reference(x, w, None)
    assert ((y.double() - exact).abs() <= tol).all()
    x3 = torch.randn(1, 2, 64, dtype=BF16)
    assert torch.equal(linear(x3, w)[0], linear(x3[0], w))


def test_other_inputs_stay_on_torch(monkeypatch):
    """fp32 and autograd run F.linear everywhere; where bf16 is native, so do more rows than the kernel beats
    torch at and a strided weight."""
    monkeypatch.setattr(cpu_linear, "linear_bf16", lambda *a: pytest.fail("the kernel ran"))
    monkeypatch.setattr(cpu_linear, "widened", lambda *a: pytest.fail("the widened matmul ran"))
    w = torch.randn(6, 16, dtype=BF16)
    cases = [(torch.randn(1, 16), w.float()), (torch.randn(1, 16, dtype=BF16, requires_grad=True), w)]
    if not cpu_linear.bf16_emulated():
        cases += [
            (torch.randn(cpu_linear.max_rows(w) + 1, 16, dtype=BF16), w),
            (torch.randn(1, 16, dtype=BF16), torch.randn(16, 6, dtype=BF16).T),
        ]
    for x, weight in cases:
        assert not cpu_linear.serves(x, weight, None)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=0, atol=0)


@needs_avx2
def test_without_native_bf16_more_rows_run_widened(emulated, monkeypatch):
    """On a CPU without native bf16 (the widening build in charge): the kernel from 2 rows up to its limit,
    the widened matmul beyond it and for a strided weight, torch for one row, fp32 and autograd."""
    assert cpu_linear.bf16_emulated()
    limit = cpu_linear.max_rows(torch.empty(6, 16, dtype=BF16))
    assert limit == cpu_linear.WIDEN_MAX_ROWS
    ran: list[str] = []
    kernel, widened = cpu_linear.linear_bf16, cpu_linear.widened
    monkeypatch.setattr(cpu_linear, "linear_bf16", lambda *a: ran.append("kernel") or kernel(*a))
    monkeypatch.setattr(cpu_linear, "widened", lambda *a: ran.append("widened") or widened(*a))
    torch.manual_seed(4)
    w = torch.randn(6, 16, dtype=BF16)
    cases = [
        (torch.randn(2, 16, dtype=BF16), w, ["kernel"]),
        (torch.randn(limit, 16, dtype=BF16), w, ["kernel"]),
        (torch.randn(limit + 1, 16, dtype=BF16), w, ["widened"]),
        (torch.randn(2, 16, dtype=BF16), torch.randn(16, 6, dtype=BF16).T, ["widened"]),
        (torch.randn(1, 16, dtype=BF16), w, []),
        (torch.randn(1, 16), w.float(), []),
        (torch.randn(1, 16, dtype=BF16, requires_grad=True), w, []),
    ]
    for x, weight, expect in cases:
        ran.clear()
        y = linear(x, weight)
        assert ran == expect
        if expect:
            exact, tol = reference(x, weight, None)
            assert ((y.double() - exact).abs() <= tol).all()


def test_linear_module_keeps_nn_linear_names_and_trains():
    torch.manual_seed(2)
    lin = Linear(16, 6, bias=True).to(BF16)
    assert list(lin.state_dict()) == ["weight", "bias"]
    x = torch.randn(1, 16, dtype=BF16)
    lin(x).float().sum().backward()  # parameters that need grad: the autograd path, gradients arrive
    assert lin.weight.grad is not None and lin.bias.grad is not None
    with torch.no_grad():
        exact, tol = reference(x, lin.weight, lin.bias)
        assert ((lin(x).double() - exact).abs() <= tol).all()


PROMPTS = [
    "Write a short note to a friend about a trip to the mountains.",
    "How do I make a simple tomato soup?",
    "Explain what an HTTP 404 status code means.",
]


def greedy(engine: Engine, n: int) -> list[list[int]]:
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    return [
        engine.generate(input_ids=engine.tokenizer.encode(p), sampling_params=sp)["output_ids"]
        for p in PROMPTS
    ]


def decode_logits(engine: Engine, sequences: list[list[int]], n: int) -> torch.Tensor:
    """fp32 logits of the last n positions of each sequence, each from a one-token decode on a paged row."""
    return torch.cat([runner_logits(engine, ids, n_decode=n)[-n:] for ids in sequences])


@pytest.mark.parametrize("path", PATHS)
def test_bf16_decode_runs_on_the_kernel_and_stays_as_close_to_fp32(
    path, smollm2_gguf_path, monkeypatch, request
):
    """The default model in bf16, teacher-forced along the fp32 model's greedy tokens: every projection and
    the head of every decode step run in the kernel (on either path; with the widening build the prefills run
    `widened`), and its logits stay about as close to fp32's as those of bf16 on torch's matmul. Both round
    once from fp32 sums (test_kernel_rounds_once_to_nearest_even checks the kernel's rounding exactly), so
    through 30 layers their errors differ only by chance, and by more than a tight bound allows: 0.124 against
    0.105 on an AMD EPYC with AVX512-BF16, where a kernel that truncated its sums instead of rounding them
    came within 1.15 of torch's. The bound of 1.5 catches what breaks a model: a kernel that dropped the last
    8 of each row's products made 17 times torch's error. Logits, not generated tokens: any two bf16 paths
    part after a chance near-tie, so which one follows fp32 further is a coin toss."""
    n = 16

    def engine(dtype: str) -> Engine:
        return Engine(
            ServerArgs(
                model_path=smollm2_gguf_path,
                dtype=dtype,
                page_size=16,
                max_total_tokens=2048,
                disable_radix_cache=True,
            )
        )

    fp32 = engine("float32")
    try:
        sequences = [fp32.tokenizer.encode(p) + out for p, out in zip(PROMPTS, greedy(fp32, n))]
        fp32.wait_idle()
        fp32.stop_scheduler()
        reference = decode_logits(fp32, sequences, n)
    finally:
        fp32.shutdown()
    if path == "widen":
        request.getfixturevalue("emulated")
        monkeypatch.setattr(cpu_linear, "WIDEN_MIN_ROWS", 1)  # these one-row decodes on the kernel too
    bf16 = engine("bfloat16")
    try:
        bf16.wait_idle()
        bf16.stop_scheduler()
        calls = []
        real = cpu_linear.linear_bf16
        monkeypatch.setattr(cpu_linear, "linear_bf16", lambda *a: calls.append(1) or real(*a))
        on_kernel = decode_logits(bf16, sequences, n)
        assert len(calls) >= len(PROMPTS) * n * (30 * 4 + 1)  # every projection and head of every decode
        monkeypatch.setattr(cpu_linear, "max_rows", lambda weight: 0)
        monkeypatch.setattr(cpu_linear, "bf16_emulated", lambda: False)
        calls.clear()
        on_torch = decode_logits(bf16, sequences, n)
        assert not calls
    finally:
        bf16.shutdown()
    kernel_err = (on_kernel - reference).abs().mean().item()
    torch_err = (on_torch - reference).abs().mean().item()
    assert 0 < kernel_err <= 1.5 * torch_err, (kernel_err, torch_err)
    top1 = reference.argmax(-1)
    assert (on_kernel.argmax(-1) == top1).sum() >= (on_torch.argmax(-1) == top1).sum() - 2
