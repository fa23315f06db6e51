"""Greedy equivalence with --attention-backend triton (every kernel: extend, decode, tree verify, cascade draft
decode). On the CPU the kernels run in the Triton interpreter, so this is a reduced matrix with short outputs;
on a GPU the same test runs natively."""

from __future__ import annotations

import pytest

from spec_utils import make_perturbed_copy, make_sharp_target
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

SP = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = [[5 + (i * 7) % 100 for i in range(n)] for n in (15, 16, 17)]
# A fixed pool: on a GPU it would otherwise be sized from free memory (~10^8 one-token pages for this tiny model,
# a host free list the idle leak check walks every step), and the next engine would see the cached blocks of
# the previous one as used.
POOL = 16384


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_spec")
    target = make_sharp_target(str(root / "target"), num_layers=2)
    draft = make_perturbed_copy(target, str(root / "draft"), noise=0.02)
    plain = Engine(ServerArgs(model_path=target, dtype="float32", page_size=1, max_total_tokens=POOL))
    try:
        ref = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=SP)]
    finally:
        plain.shutdown()
    return target, draft, ref


@pytest.mark.slow
@pytest.mark.parametrize("page,topk,version", [(16, 4, 2), (4, 8, 1), (1, 1, 2)])
def test_triton_backend_greedy_equivalence(ckpts, page, topk, version):
    target, draft, ref = ckpts
    steps, n = (3, 8) if topk > 1 else (3, 4)
    eng = Engine(
        ServerArgs(
            model_path=target,
            dtype="float32",
            page_size=page,
            attention_backend="triton",
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=draft,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=n,
            disable_overlap_schedule=version == 1,
            max_total_tokens=POOL,
        )
    )
    try:
        out = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert out == ref
        eng.wait_idle()
        assert eng.memory_report()["used_pages"] == 0
    finally:
        eng.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_triton_backend_cycling_shapes(ckpts, version):
    """Adaptive speculation's debug schedule (a different shape every round, OFF included) on the triton
    kernels: the cascade draft decode and the tail duplication see K and S change between rounds."""
    target, draft, ref = ckpts
    eng = Engine(
        ServerArgs(
            model_path=target,
            dtype="float32",
            page_size=16,
            attention_backend="triton",
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=draft,
            speculative_num_steps=3,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
            speculative_adaptive=True,
            speculative_adaptive_debug_cycle=True,
            disable_overlap_schedule=version == 1,
            max_total_tokens=POOL,
        )
    )
    try:
        out = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert out == ref
        rounds = eng.get_server_info()["speculative_adaptive"]["rounds"]
        assert sum(n > 0 for n in rounds.values()) >= 3, rounds  # 10 tokens: a few rounds, each a new shape
        eng.wait_idle()
        assert eng.memory_report()["used_pages"] == 0
    finally:
        eng.shutdown()
