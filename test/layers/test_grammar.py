"""Structured output (layers/grammar.py): xgrammar masks along each row's path, and draft pruning.

Unit: the processor's path walk against a fresh xgrammar matcher per row (a sequential walk of that row's
history); the matcher is back where it started after every walk; stop tokens only once the grammar ended;
rejected paths; the draft mask. Engine: constrained greedy output fullmatches its regex / parses as its schema;
20 regexes / JSON schemas / EBNF grammars / choices give the same tokens with tree speculation as without (fp32)
over STANDALONE and EAGLE-3 (whose draft vocabulary lacks a token some grammars force) x K {1, 8} x P {1, 64} x
spec v1 / v2, under the adaptive debug cycle and through a retraction, with zero leaked pages.
"""

from __future__ import annotations

import json
import queue
import random
import re

import pytest
import torch

from conftest import build_tiny_tokenizer
from spec_utils import (
    assert_no_leak,
    make_eagle_head,
    make_perturbed_copy,
    make_sharp_target,
    standalone_engine,
)
from treepage.core import SamplingParamError, SamplingParams
from treepage.entrypoints.engine import CumulativeOutput, Engine
from treepage.layers.grammar import GrammarCompiler, GrammarProcessor
from treepage.server_args import ServerArgs

V = 130  # the tiny tokenizer's 128 ids, padded like a model whose logits are wider than its vocabulary
EOS = 2


def tid(c: str) -> int:
    """The tiny tokenizer's id of a printable character (conftest.build_tiny_tokenizer)."""
    return 3 if c == "\n" else 4 + ord(c) - 32


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(build_tiny_tokenizer(), V, [EOS])


def _rows(bitmask: torch.Tensor) -> list[set[int]]:
    return [{t for t in range(V) if (int(row[t // 32]) >> (t % 32)) & 1} for row in bitmask]


def _sequential(compiler: GrammarCompiler, field: str, value: str, history: list[int], path: list[int]):
    """What a fresh matcher allows after history + path (None: the path is rejected)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiler.compile(field, value), override_stop_tokens=[EOS])
    for t in history + path:
        if m.is_terminated():
            if t != EOS:
                return None
        elif not m.accept_token(t):
            return None
    if m.is_terminated():
        return {EOS}
    bm = xgr.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(bm, 0)
    return _rows(bm)[0]


def _ids(s: str) -> list[int]:
    return [tid(c) for c in s]


TREE_CASES = [
    ("regex", r"(ab|ac)[0-9]{1,3}x?", _ids("a"), [[], _ids("b"), _ids("c"), _ids("b1"), _ids("b12"), _ids("d"),
                                                 _ids("c9x"), _ids("c9x") + [EOS], _ids("b1") + [EOS, EOS]]),
    ("json_schema", '{"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}', [],
     [[], _ids("{"), _ids('{"'), _ids('{"k": t'), _ids('{"k": x'), _ids('{"k": true}'), _ids('{"k": true}') + [EOS]]),
    ("ebnf", 'root ::= "x" [0-9]+ "y"', _ids("x1"), [[], _ids("2"), _ids("y"), _ids("y") + [EOS, EOS], _ids("z")]),
]  # fmt: skip


@pytest.mark.parametrize("field,value,history,paths", TREE_CASES)
def test_path_walk_equals_a_sequential_matcher_per_row(compiler, field, value, history, paths):
    sp = SamplingParams(**{field: value})
    proc = compiler.processor(sp, [EOS])
    assert proc is not None
    proc.accept(history)
    shuffled = list(paths)
    random.Random(0).shuffle(shuffled)  # any row order: the walk sorts by path and rolls back between rows
    bitmask, rejected = proc.fill(shuffled)
    got = _rows(bitmask)
    for i, path in enumerate(shuffled):
        want = _sequential(compiler, field, value, history, path)
        if want is None:
            assert i in rejected and got[i] == {EOS}, path  # never accepted by verification: a harmless row
        else:
            assert i not in rejected and got[i] == want, path
    # rollback restored the state: the empty path allows what the history alone allows
    again, _ = proc.fill([[]])
    assert _rows(again)[0] == _sequential(compiler, field, value, history, [])


def test_apply_masks_logits_and_allowed_matches(compiler):
    proc = compiler.processor(SamplingParams(regex="[ab]c"), [EOS])
    assert proc is not None
    paths = [[], [tid("a")], [tid("a"), tid("c")], [tid("z")]]
    logits = torch.randn(4, V)
    want = logits.clone()
    proc.apply(logits, paths)
    allowed = proc.allowed(paths)
    assert allowed is not None
    for i, ok in enumerate([{tid("a"), tid("b")}, {tid("c")}, {EOS}, set()]):
        assert {t for t in range(V) if allowed[i, t]} == ok
        finite = {t for t in range(V) if logits[i, t] > float("-inf")}
        assert finite == (ok or {EOS})  # a rejected row keeps the stop tokens only
        assert torch.equal(logits[i, sorted(finite)], want[i, sorted(finite)])


def test_terminated_grammar_allows_only_stop_tokens_and_reset(compiler):
    proc = compiler.processor(SamplingParams(choice=["ok"], ignore_eos=True), [EOS])
    assert isinstance(proc, GrammarProcessor)
    proc.accept(_ids("ok") + [EOS, EOS])  # ignore_eos: stop tokens after the end are accepted
    assert not proc.failed
    assert _rows(proc.fill([[], [EOS]])[0]) == [{EOS}, {EOS}]
    proc.reset()
    assert _rows(proc.fill([[]])[0]) == [{tid("o")}]


def test_request_stop_token_ids_end_a_complete_grammar(compiler):
    proc = compiler.processor(SamplingParams(regex="a", stop_token_ids=[7]), [EOS])
    assert proc is not None
    assert _rows(proc.fill([[tid("a")]])[0]) == [{EOS, 7}]


@pytest.mark.parametrize(
    "field,value",
    [("regex", "a("), ("json_schema", "{not json"), ("json_schema", '{"type": "no-such-type"}'),
     ("ebnf", "root ::= "), ("ebnf", "start ::= \"a\""), ("choice", ["a", 3]),
     ("structural_tag", "[1]")],
)  # fmt: skip
def test_invalid_constraints_name_the_field(compiler, field, value):
    sp = SamplingParams(**{field: value})
    with pytest.raises(SamplingParamError) as exc:
        g = sp.grammar
        assert g is not None
        compiler.compile(*g)
    assert exc.value.param == field and field in str(exc.value)


def test_one_constraint_per_request():
    with pytest.raises(SamplingParamError) as exc:
        SamplingParams(regex="a", json_schema="{}").validate(V)
    assert "json_schema" in str(exc.value) and "regex" in str(exc.value)


def test_structural_tag_sglang_form(compiler):
    tag = {"type": "structural_tag", "triggers": ["<f>"],
           "structures": [{"begin": "<f>", "schema": {"type": "boolean"}, "end": "</f>"}]}  # fmt: skip
    proc = compiler.processor(SamplingParams(structural_tag=json.dumps(tag)), [EOS])
    assert proc is not None
    proc.accept(_ids("hi <f>"))
    assert _rows(proc.fill([[]])[0]) == [{tid("t"), tid("f")}]


# ---- engines -----------------------------------------------------------------------------------------------------
FORCED = "q"  # a character the EAGLE-3 head below can never draft; some grammars force it


def _obj(props: dict, required: list[str] | None = None) -> str:
    return json.dumps({"type": "object", "properties": props, "required": required or list(props)})


GRAMMARS: list[tuple[str, object]] = [
    ("regex", r"[a-z]{3,8}( [a-z]{2,6}){2,4}\."),
    ("regex", r"(yes|no|maybe)"),
    ("regex", r"[0-9]{3}-[0-9]{4}"),
    ("regex", r"q[a-z]{2}q[0-9]q"),  # forces FORCED three times
    ("regex", r"(the|a|an) [a-z]{1,6} (is|was) [a-z]{1,8}"),
    ("regex", r"[A-Z][a-z]{1,6}, [A-Z][a-z]{1,6}!"),
    ("regex", r"\([0-9]{1,2}(,[0-9]{1,2}){1,3}\)"),
    ("regex", r"[a-f0-9]{8}"),
    ("json_schema", _obj({"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "string", "maxLength": 6}})),
    ("json_schema", _obj({"ok": {"type": "boolean"}})),
    ("json_schema", _obj({"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": -9, "maximum": 9}})),
    ("json_schema", _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}})),
    ("json_schema", _obj({"p": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                               "required": ["x"]}, "q": {"type": "null"}})),
    ("json_schema", _obj({"quiz": {"const": "qq"}, "v": {"type": "boolean"}})),  # forces FORCED
    ("json_schema", json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4})),
    ("ebnf", 'root ::= "x" [0-9] [0-9]? [0-9]? "y"'),
    ("ebnf", 'root ::= item (", " item)? (", " item)?\nitem ::= [a-z] [a-z]?'),
    ("ebnf", 'root ::= "(" term ("+" term)? ("+" term)? ")"\nterm ::= [0-9] | "(" [0-9] "*" [0-9] ")"'),
    ("choice", ["quick", "quiet", "quantum"]),  # forces FORCED first
    ("choice", ["alpha", "beta", "gamma"]),
]
assert len(GRAMMARS) == 20
MAX_NEW = 40


def _params(field: str, value: object) -> dict:
    return {"temperature": 0, "max_new_tokens": MAX_NEW, field: value}


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(3, 127) for _ in range(n)] for n in (3, 17, 63, 64, 70) * 4]


def _run(eng: Engine, params: list[dict], prompts: list[list[int]] | None = None) -> list[CumulativeOutput]:
    sinks: list[queue.Queue] = [queue.Queue() for _ in params]
    for ids, sp, q in zip(prompts or _prompts(), params, sinks):
        eng.submit(ids, eng.make_sampling_params(sp), q.put)
    outs = []
    for q in sinks:
        acc = CumulativeOutput()
        while not acc.finished:
            acc.add(q.get(timeout=120))
        outs.append(acc)
    return outs


def _check_schema(value: object, schema: dict) -> None:
    """The subset of JSON Schema the schemas above use."""
    if "const" in schema:
        assert value == schema["const"]
    if "enum" in schema:
        assert value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
        assert set(value) <= set(schema["properties"])
        for k, v in value.items():
            _check_schema(v, schema["properties"][k])
    elif kind == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
        for v in value:
            _check_schema(v, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "null":
        assert value is None


EBNF_AS_REGEX = {
    'root ::= "x" [0-9] [0-9]? [0-9]? "y"': r"x[0-9]{1,3}y",
    'root ::= item (", " item)? (", " item)?\nitem ::= [a-z] [a-z]?': r"[a-z]{1,2}(, [a-z]{1,2}){0,2}",
    'root ::= "(" term ("+" term)? ("+" term)? ")"\nterm ::= [0-9] | "(" [0-9] "*" [0-9] ")"':
        r"\((\d|\(\d\*\d\))(\+(\d|\(\d\*\d\))){0,2}\)",
}


def _check_output(field: str, value: object, text: str) -> None:
    if field == "regex":
        assert re.fullmatch(str(value), text), (value, text)
    elif field == "json_schema":
        _check_schema(json.loads(text), json.loads(str(value)))
    elif field == "choice":
        assert text in value  # type: ignore[operator]
    else:
        assert re.fullmatch(EBNF_AS_REGEX[str(value)], text), (value, text)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    target = make_sharp_target(str(root / "target"))
    return {
        "target": target,
        "draft": make_perturbed_copy(target, str(root / "draft"), noise=0.02),
        "eagle3": make_eagle_head(
            target, str(root / "eagle3"), "EAGLE3", draft_vocab_size=64, never_draft=(tid(FORCED),)
        ),
    }


@pytest.fixture(scope="module")
def reference(ckpts):
    """Constrained plain greedy decoding: every output ends by the grammar and follows it."""
    eng = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=1))
    try:
        outs = _run(eng, [_params(f, v) for f, v in GRAMMARS])
        free = _run(eng, [{"temperature": 0, "max_new_tokens": MAX_NEW}] * len(GRAMMARS))
    finally:
        eng.shutdown()
    for (field, value), out in zip(GRAMMARS, outs):
        assert out.meta_info["finish_reason"]["type"] == "stop", (field, value, out.text)
        _check_output(field, value, out.text)
    assert all(o.output_ids != f.output_ids for o, f in zip(outs, free))  # every constraint changed the output
    assert sum(tid(FORCED) in o.output_ids for o in outs) >= 3
    return [o.output_ids for o in outs]


def _check_exact(eng: Engine, reference: list[list[int]]) -> None:
    got = [o.output_ids for o in _run(eng, [_params(f, v) for f, v in GRAMMARS])]
    assert got == reference
    dbg = eng.worker.debug.to_dict()
    assert any(a >= 3 for a in dbg["accept_len_hist"]), dbg  # paths of several drafted tokens were accepted
    assert_no_leak(eng)


@pytest.mark.parametrize(
    "version,page,topk",
    [pytest.param(v, p, k, marks=[] if (v, p, k) == (2, 64, 8) else [pytest.mark.slow])  # one case by default
     for v in (1, 2) for p in (1, 64) for k in (1, 8)],
)  # fmt: skip
def test_constrained_speculation_equals_plain(ckpts, reference, version, page, topk, monkeypatch):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = standalone_engine(ckpts["target"], ckpts["draft"], topk, page, version)
    try:
        _check_exact(eng, reference)
    finally:
        eng.shutdown()


def _eagle3(ckpts, version: int, topk: int = 8, page: int = 64, **kw) -> Engine:
    steps, k, n = {1: (3, 1, 4), 8: (4, 8, 16)}[topk]
    return Engine(
        ServerArgs(
            model_path=ckpts["target"],
            dtype="float32",
            page_size=page,
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=ckpts["eagle3"],
            speculative_num_steps=steps,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
            disable_overlap_schedule=version == 1,
            **kw,
        )
    )


@pytest.mark.parametrize(
    "version,topk,prune",
    [(2, 8, "1"), pytest.param(1, 8, "1", marks=pytest.mark.slow), pytest.param(2, 1, "1", marks=pytest.mark.slow),
     pytest.param(2, 8, "0", marks=pytest.mark.slow)],
)  # fmt: skip
def test_eagle3_grammar_forcing_a_token_the_draft_never_proposes(ckpts, reference, version, topk, prune, monkeypatch):
    """The EAGLE-3 draft vocabulary lacks FORCED: every forced FORCED comes from a verify row whose tree cannot
    hold it (the round's bonus token), with draft pruning on or off."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    monkeypatch.setenv("TREEPAGE_GRAMMAR_DRAFT_PRUNE", prune)
    eng = _eagle3(ckpts, version, topk)
    try:
        drafted = eng.worker.draft.model.map_to_target_ids(torch.arange(64))
        assert tid(FORCED) not in drafted.tolist()
        assert [o.output_ids for o in _run(eng, [_params(f, v) for f, v in GRAMMARS])] == reference
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_constrained_adaptive_debug_cycle_equals_plain(ckpts, reference, version, monkeypatch):
    """Every round changes shape, OFF rounds included: the matcher sees every emitted token either way."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = standalone_engine(
        ckpts["target"], ckpts["draft"], 8, 4, version, speculative_adaptive=True, speculative_adaptive_debug_cycle=True
    )
    try:
        _check_exact(eng, reference)
        assert eng.get_server_info()["speculative_adaptive"]["rounds"]["off"] > 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version,pool", [(1, 160), pytest.param(2, 320, marks=pytest.mark.slow)])
def test_retracted_constrained_requests_equal_plain(ckpts, version, pool, monkeypatch):
    """A pool too small for the batch: retracted requests re-prefill with their output so far and their matchers
    are replayed to it (spec v2 drops a drained round's tokens), still emitting plain decoding's tokens."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    rng = random.Random(1)
    short = [[rng.randint(3, 127) for _ in range(n)] for n in (4, 3, 11, 12, 20)]
    params = [_params(f, v) for f, v in GRAMMARS[8:13]]  # JSON: long enough outputs to outgrow the pool
    plain = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=1))
    try:
        want = [o.output_ids for o in _run(plain, params, short)]
    finally:
        plain.shutdown()
    eng = standalone_engine(ckpts["target"], ckpts["draft"], 8, 4, version, max_total_tokens=pool, max_running_requests=5)
    try:
        assert [o.output_ids for o in _run(eng, params, short)] == want
        assert eng.scheduler.stats.num_retracted > 0
        assert_no_leak(eng)
    finally:
        eng.shutdown()


def test_ignore_eos_and_max_new_tokens(ckpts):
    """ignore_eos: stop tokens only once the grammar ended, up to max_new_tokens; a short max_new_tokens cuts
    the text (allowed, as in SGLang)."""
    eng = standalone_engine(ckpts["target"], ckpts["draft"], 8, 64, 2)
    try:
        done = eng.generate(input_ids=[5, 6, 7], sampling_params={**_params("choice", ["yes"]), "ignore_eos": True})
        ids = done["output_ids"]
        assert done["text"] == "yes" and len(ids) == MAX_NEW and set(ids[ids.index(EOS) :]) == {EOS}
        cut = eng.generate(input_ids=[5, 6, 7], sampling_params={**_params("regex", "[a-z]{20}"), "max_new_tokens": 5})
        assert cut["meta_info"]["finish_reason"]["type"] == "length" and re.fullmatch("[a-z]{5}", cut["text"])
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_default_model_json_schema_output_parses(smollm2_gguf_path):
    """The shipped SmolLM2 (plain decoding): a chat request constrained by a schema returns a valid object."""
    eng = Engine(ServerArgs(model_path=smollm2_gguf_path, dtype="float32"))
    try:
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                   "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
        from treepage.managers.tokenizer import apply_chat_template

        ids = apply_chat_template(eng.tokenizer, [{"role": "user", "content": "Invent a person. Answer in JSON."}])
        out = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 48,
                                                            "json_schema": json.dumps(schema)})  # fmt: skip
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        _check_schema(json.loads(out["text"]), schema)
        regex = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 16,
                                                              "regex": r"[A-Z][a-z]+ is [0-9]{2}\."})  # fmt: skip
        assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{2}\.", regex["text"])
    finally:
        eng.shutdown()
