"""Engine API on the tiny model: finish reasons, stops, seeded sampling, validation, cancellation."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch

from spec_utils import standalone_engine
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

EOS = 2  # <|im_end|> in the tiny checkpoint (config eos_token_id and the tokenizer's eos)
POOL_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str):
    eng = Engine(ServerArgs(model_path=tiny_llama_dir, dtype="float32", page_size=4, max_total_tokens=4096))
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _memory_returns_to_zero(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.wait_idle()
        mem = eng.memory_report()
        assert (mem["used_pages"], mem["used_rows"]) == (0, 0), mem


def greedy(n: int, **kw) -> dict:
    return {"temperature": 0, "max_new_tokens": n, **kw}


@pytest.fixture(scope="module")
def greedy_pool(engine: Engine) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy continuation with ignore_eos) for many random prompts, decoded as one batch."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, engine.vocab_size, (256, 8), generator=g).tolist()
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(POOL_TOKENS, ignore_eos=True))
    return [(p, o["output_ids"]) for p, o in zip(prompts, outs)]


def test_max_new_tokens_finishes_with_length(engine: Engine) -> None:
    prompts = [[5, 6, 7], list(range(3, 40)), [9] * 11]
    for n in (1, 7, 13):
        outs = engine.generate(input_ids=prompts, sampling_params=greedy(n, ignore_eos=True))
        for p, o in zip(prompts, outs):
            assert o["finished"]
            assert len(o["output_ids"]) == n
            meta = o["meta_info"]
            assert meta["finish_reason"] == {"type": "length", "length": n}
            assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(p), n)


def test_eos_stops_generation(engine: Engine, greedy_pool) -> None:
    assert EOS in engine.eos_ids
    hits = [(p, o, o.index(EOS)) for p, o in greedy_pool if EOS in o[1:]]
    assert hits, "no greedy continuation in the pool reaches EOS"
    prompt, full, k = max(hits, key=lambda h: h[2])  # the latest EOS: most tokens before it
    assert k >= 1
    out = engine.generate(input_ids=prompt, sampling_params=greedy(POOL_TOKENS))
    assert out["output_ids"] == full[: k + 1]  # the EOS token is reported ...
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["text"] == engine.tokenizer.decode(full[:k], skip_special_tokens=True)  # ... not in the text
    # ignore_eos keeps going through it.
    assert (
        engine.generate(input_ids=prompt, sampling_params=greedy(POOL_TOKENS, ignore_eos=True))["output_ids"]
        == full
    )


def _first_new_token(seq: list[int]) -> tuple[int, int]:
    """(index, token) of the latest first occurrence of any token in seq."""
    first: dict[int, int] = {}
    for i, t in enumerate(seq):
        first.setdefault(t, i)
    t = max(first, key=first.get)
    return first[t], t


def test_stop_token_ids(engine: Engine, greedy_pool) -> None:
    cands = [(p, o, *_first_new_token(o)) for p, o in greedy_pool if min(o) >= 3]
    # The latest first occurrence that still leaves tokens after it, so the cut is visible.
    prompt, full, k, tok = max((c for c in cands if c[2] < POOL_TOKENS - 4), key=lambda c: c[2])
    assert k >= 2
    out = engine.generate(input_ids=prompt, sampling_params=greedy(POOL_TOKENS, stop_token_ids=[tok]))
    assert out["output_ids"] == full[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert out["text"] == engine.tokenizer.decode(full[:k], skip_special_tokens=True)


def test_stop_string_truncates_text(engine: Engine, greedy_pool) -> None:
    best = None
    for p, o in greedy_pool:
        if min(o) < 3:  # no special tokens: the text is then exactly the decoded ids
            continue
        text = engine.tokenizer.decode(o, skip_special_tokens=True)
        # A 2-character stop string whose first occurrence is as late as possible.
        pos = max((text.find(text[i : i + 2]), i) for i in range(len(text) - 1))[0]
        if best is None or pos > best[3]:
            best = (p, o, text, pos)
    prompt, full, text, pos = best
    assert pos >= 2
    stop = text[pos : pos + 2]
    for stop_param in (stop, [stop, "never-generated-\u2603"]):
        out = engine.generate(
            input_ids=prompt, sampling_params=greedy(POOL_TOKENS, ignore_eos=True, stop=stop_param)
        )
        assert out["text"] == text[:pos]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        ids = out["output_ids"]
        assert ids == full[: len(ids)] and len(ids) < len(full)  # stopped early, on the same greedy path


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("Once upon a time")

    def run(seed: int, **kw) -> list[int]:
        sp = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "seed": seed, **kw}
        return engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]

    a = run(1234)
    assert a == run(1234)
    assert a != run(1235)
    assert len(set(a)) > 3  # really sampled, not a greedy loop
    for kw in ({"top_k": 5}, {"top_p": 0.8}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9}):
        b = run(99, **kw)
        assert b == run(99, **kw)
    # A seed pins a request's draws whatever else shares its batch.
    sp = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "seed": 1234}
    batch = engine.generate(input_ids=[prompt, [7] * 30, prompt], sampling_params=sp)
    assert batch[0]["output_ids"] == batch[2]["output_ids"] == a


def test_a_list_of_sampling_params_gives_each_prompt_its_own(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("Once upon a time")
    sp = [{"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "seed": s} for s in (7, 8)]
    sp.append(greedy(10))
    batch = engine.generate(input_ids=[prompt] * 3, sampling_params=sp)
    alone = [engine.generate(input_ids=prompt, sampling_params=p)["output_ids"] for p in sp]
    assert [o["output_ids"] for o in batch] == alone
    assert alone[0] != alone[1] and len(alone[2]) == 10
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        engine.generate(input_ids=[prompt] * 3, sampling_params=sp[:2])
    with pytest.raises(ValueError, match="same n"):
        engine.generate(input_ids=[prompt] * 2, sampling_params=[{"n": 2}, {"n": 1}])


def test_top_k_one_is_greedy(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("top k of one")
    ref = engine.generate(input_ids=prompt, sampling_params=greedy(16, ignore_eos=True))["output_ids"]
    sp = {"temperature": 1.0, "top_k": 1, "max_new_tokens": 16, "ignore_eos": True, "seed": 5}
    assert engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"] == ref


@pytest.mark.parametrize(
    "params,match",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [128]}, "stop_token_ids"),
        ({"frequency_sauce": 1}, "unknown sampling parameter"),
    ],
)
def test_sampling_params_are_validated(engine: Engine, params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.generate(input_ids=[5, 6, 7], sampling_params=params)


def test_prompt_is_validated(engine: Engine) -> None:
    ctx = engine.context_len
    assert ctx == 512
    with pytest.raises(ValueError, match="empty"):
        engine.generate(prompt="", sampling_params=greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[[]], sampling_params=greedy(4))
    with pytest.raises(ValueError, match=r"input_ids must be integers in \[0, 128\)"):
        engine.generate(input_ids=[5, 128], sampling_params=greedy(4))
    with pytest.raises(ValueError, match=f"prompt has {ctx} tokens.*context length is {ctx}"):
        engine.generate(input_ids=[5] * ctx, sampling_params=greedy(1))
    with pytest.raises(ValueError, match=f"maximum context length of {ctx}.*500 in the prompt \\+ 13"):
        engine.generate(input_ids=[5] * 500, sampling_params=greedy(13))
    # Exactly filling the context is allowed and finishes by length.
    out = engine.generate(input_ids=[5] * 500, sampling_params=greedy(12, ignore_eos=True))
    assert len(out["output_ids"]) == 12
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_empty_input_ids_are_rejected(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[], sampling_params=greedy(4))


def test_zero_max_new_tokens(engine: Engine) -> None:
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=greedy(0))
    assert out["finished"] and out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}

    async def stream() -> list[dict]:
        return [o async for o in engine.generate_async([5, 6, 7], {"max_new_tokens": 0})]

    outs = asyncio.run(stream())
    assert len(outs) == 1 and outs[0]["finished"] and outs[0]["output_ids"] == []


def test_text_prompt_matches_input_ids(engine: Engine) -> None:
    texts = ["hello there", "the end of the"]
    by_text = engine.generate(prompt=texts, sampling_params=greedy(8, ignore_eos=True))
    by_ids = engine.generate(
        input_ids=[engine.tokenizer.encode(t) for t in texts], sampling_params=greedy(8, ignore_eos=True)
    )
    assert [o["output_ids"] for o in by_text] == [o["output_ids"] for o in by_ids]
    single = engine.generate(prompt=texts[0], sampling_params=greedy(8, ignore_eos=True))
    assert isinstance(single, dict) and single["output_ids"] == by_text[0]["output_ids"]


def test_generate_async_streams_cumulative_snapshots(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("stream me")
    ref = engine.generate(input_ids=prompt, sampling_params=greedy(20, ignore_eos=True))

    async def stream() -> list[dict]:
        return [o async for o in engine.generate_async(prompt, greedy(20, ignore_eos=True))]

    outs = asyncio.run(stream())
    assert outs[-1]["finished"] and not any(o["finished"] for o in outs[:-1])
    assert outs[-1]["output_ids"] == ref["output_ids"] and outs[-1]["text"] == ref["text"]
    for a, b in zip(outs, outs[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]


def test_breaking_out_of_generate_async_aborts(engine: Engine) -> None:
    max_new = 400
    before = engine.scheduler.stats.gen_tokens_total

    async def consume_two() -> list[dict]:
        got = []
        async for out in engine.generate_async([5, 6, 7, 8], greedy(max_new, ignore_eos=True)):
            got.append(out)
            if len(got) == 2:
                break
        return got

    got = asyncio.run(consume_two())
    assert len(got) == 2 and not got[-1]["finished"]
    engine.wait_idle()
    generated = engine.scheduler.stats.gen_tokens_total - before
    assert 2 <= generated < max_new  # aborted long before max_new_tokens
    mem = engine.memory_report()
    assert (mem["used_pages"], mem["used_rows"]) == (0, 0)


def test_abandoned_stream_does_not_kill_other_requests(engine: Engine) -> None:
    """An aborted generate_async whose event loop has closed must not take the running batch down with it."""
    result: dict = {}
    started = threading.Event()

    def bystander() -> None:
        started.set()
        result["out"] = engine.generate(input_ids=[9, 10, 11], sampling_params=greedy(300, ignore_eos=True))

    t = threading.Thread(target=bystander)
    t.start()
    started.wait()

    async def consume_two_and_leave() -> None:
        n = 0
        async for _ in engine.generate_async([5, 6, 7, 8], greedy(300, ignore_eos=True)):
            n += 1
            if n == 2:
                break

    asyncio.run(consume_two_and_leave())  # the loop is closed when the scheduler applies the abort
    t.join(timeout=60)
    assert result["out"]["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("version", [0, 1, 2], ids=["plain", "spec-v1", "spec-v2"])
def test_shutdown_gives_the_kv_memory_back(tiny_llama_dir: str, version: int) -> None:
    """An engine sits in reference cycles (its threads and callbacks), so a dropped one is freed only by a full
    garbage collection: shutdown must free the KV pools itself (the suite once ran out of memory, an engine's
    default gigabyte at a time). With the garbage collector off, engine after engine must not add up. (The
    process may keep freed memory for the next allocation, so the check is on growth, not on each release.)"""

    def run_one() -> float:
        if version:
            eng = standalone_engine(tiny_llama_dir, tiny_llama_dir, 4, 4, version, cpu_kv_cache_gb=0.25)
        else:
            eng = Engine(ServerArgs(model_path=tiny_llama_dir, dtype="float32", page_size=4, cpu_kv_cache_gb=0.25))
        out = eng.generate(input_ids=[5, 6, 7], sampling_params=greedy(8, ignore_eos=True))
        assert len(out["output_ids"]) == 8
        pools = [r.kv_pool for r in eng.worker.model_runners()]
        assert len(pools) == (2 if version else 1)
        held_mib = sum(p.nbytes for p in pools) / 2**20
        eng.shutdown()
        assert all(p.nbytes == 0 for p in pools)
        return held_mib

    threads = set(threading.enumerate())
    gc.collect()
    gc.disable()
    try:
        held_mib = run_one()
        first = _rss_mib()
        for _ in range(3):
            run_one()
        assert _rss_mib() - first < 0.5 * held_mib, (first, _rss_mib(), held_mib)
        started = {t.name for t in set(threading.enumerate()) - threads}
        assert not [n for n in started if n.startswith("treepage-")]  # the scheduler loop, spec v2's forward thread
    finally:
        gc.enable()
