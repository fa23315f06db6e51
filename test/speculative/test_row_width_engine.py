"""The row-width invariant end to end: narrow rows overflow at large pages and topk; widened rows do not.

DESIGN §3: a row narrower than committed + reserve would let the round's slot write spill into the
neighbour row, and the clamped free at request end would then leak pages. The always-on check stops the
request with a clear error instead; with the widened rows the same workloads complete with zero leaks.
"""

from __future__ import annotations

import pytest

from spec_utils import assert_no_leak, make_perturbed_copy, make_sharp_target
from treepage.entrypoints.engine import Engine
from treepage.mem_cache.sizing import NARROW_ROWS_ENV
from treepage.server_args import ServerArgs

CONTEXT = 512


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    target = make_sharp_target(str(root / "target"), num_layers=2)
    return target, make_perturbed_copy(target, str(root / "draft"), noise=0.02)


def engine(ckpts, page: int) -> Engine:
    target, draft = ckpts
    return Engine(
        ServerArgs(
            model_path=target,
            dtype="float32",
            page_size=page,
            context_length=CONTEXT,
            max_total_tokens=64 * 1024,
            max_running_requests=4,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=draft,
            speculative_num_steps=5,
            speculative_eagle_topk=8,
            speculative_num_draft_tokens=32,
        )
    )


def long_prompt(n: int) -> list[int]:
    return [3 + (i * 7) % 120 for i in range(n)]


def conversation(eng: Engine) -> list[dict]:
    """A multi-turn chat that grows until the context limit; each turn re-sends the whole history."""
    history: list[int] = long_prompt(40)
    outs = []
    while len(history) + 24 < CONTEXT:
        out = eng.generate(
            input_ids=history, sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
        )
        outs.append(out)
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            break
        history = history + out["output_ids"] + long_prompt(60)
    return outs


@pytest.mark.parametrize("page,workload", [(256, "long_prompt"), (512, "multi_turn")])
def test_narrow_rows_are_caught(ckpts, monkeypatch, page, workload):
    monkeypatch.setenv(NARROW_ROWS_ENV, "1")
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = engine(ckpts, page)
    try:
        assert eng.memory_report()["row_width"] == CONTEXT + 4 + 32
        if workload == "long_prompt":
            outs = [
                eng.generate(
                    input_ids=long_prompt(CONTEXT - 40),
                    sampling_params={"max_new_tokens": 8, "temperature": 0},
                )
            ]
        else:
            outs = conversation(eng)
        reason = outs[-1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        msg = reason["message"]
        for needle in (
            "nxt=",
            f"rows are {CONTEXT + 36} wide",
            f"page_size={page}",
            "topk=8",
            "num_steps=5",
            "num_draft_tokens=32",
            NARROW_ROWS_ENV,
        ):
            assert needle in msg, msg
        assert_no_leak(eng)
        # The server keeps serving: a short request still completes.
        ok = eng.generate(input_ids=long_prompt(10), sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert (
            ok["meta_info"]["finish_reason"]["type"] != "abort"
            or "nxt=" in ok["meta_info"]["finish_reason"]["message"]
        )
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("page,workload", [(256, "long_prompt"), (512, "multi_turn")])
def test_widened_rows_complete(ckpts, monkeypatch, page, workload):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = engine(ckpts, page)
    plain = Engine(ServerArgs(model_path=ckpts[0], dtype="float32", page_size=1, context_length=CONTEXT))
    try:
        # 2 * alloc_len + P - 1 with alloc_len = ceil((P - 1 + S) / P) * P * K
        assert eng.memory_report()["row_width"] == CONTEXT + 2 * 2 * page * 8 + page - 1
        if workload == "long_prompt":
            sp = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
            out = eng.generate(input_ids=long_prompt(CONTEXT - 40), sampling_params=sp)
            assert (
                out["output_ids"]
                == plain.generate(input_ids=long_prompt(CONTEXT - 40), sampling_params=sp)["output_ids"]
            )
        else:
            outs = conversation(eng)
            assert len(outs) >= 5
            assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert_no_leak(eng)
    finally:
        eng.shutdown()
        plain.shutdown()
