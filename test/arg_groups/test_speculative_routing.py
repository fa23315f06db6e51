"""Table-driven test of every routing and validation rule of arg_groups/speculative.py (DESIGN §6)."""

from __future__ import annotations

import pytest

from treepage.arg_groups.speculative import resolve_speculative
from treepage.layers.attention.registry import paged_tree_backends
from treepage.server_args import ArgumentError, ServerArgs


def args(**kw) -> ServerArgs:
    kw.setdefault("speculative_draft_model_path", "draft")
    return ServerArgs(**kw)


ROUTES = [
    # (kwargs, architecture, expected spec_version, expected (S, K, N))
    (
        dict(
            speculative_algorithm="EAGLE3",
            speculative_num_steps=5,
            speculative_eagle_topk=8,
            speculative_num_draft_tokens=32,
            page_size=64,
        ),
        "LlamaForCausalLM",
        2,
        (5, 8, 32),
    ),
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=5,
            speculative_eagle_topk=8,
            speculative_num_draft_tokens=64,
            page_size=4,
            disable_overlap_schedule=True,
        ),
        "LlamaForCausalLM",
        1,
        (5, 8, 64),
    ),
    (dict(speculative_algorithm="EAGLE", page_size=1), "LlamaForCausalLM", 2, (5, 4, 8)),
    (dict(speculative_algorithm="STANDALONE", page_size=1), "LlamaForCausalLM", 2, (3, 1, 4)),
    (dict(speculative_algorithm="EAGLE", page_size=1), "Qwen2ForCausalLM", 2, (3, 1, 4)),
    # topk == 1 forces N = S + 1
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=16,
            page_size=16,
        ),
        "LlamaForCausalLM",
        2,
        (3, 1, 4),
    ),
    # topk > 1 with page 1 is fine on any backend
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
            page_size=1,
            attention_backend="sdpa",
        ),
        "LlamaForCausalLM",
        2,
        (3, 4, 8),
    ),
    # topk == 1 with page > 1 is fine on any backend
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            page_size=64,
            attention_backend="sdpa",
        ),
        "LlamaForCausalLM",
        2,
        (3, 1, 4),
    ),
]


@pytest.mark.parametrize("kw,arch,version,tree", ROUTES)
def test_routes(kw, arch, version, tree):
    a = resolve_speculative(args(**kw), arch)
    assert a.spec_version == version
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == tree
    assert a.max_running_requests == 48


REFUSALS = [
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=8,
            speculative_num_draft_tokens=32,
            page_size=64,
            attention_backend="sdpa",
        ),
        "--attention-backend sdpa",
    ),
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=2,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=8,
            page_size=1,
        ),
        "larger than the tree can be",
    ),
    (
        dict(speculative_algorithm="EAGLE", speculative_num_steps=0, speculative_eagle_topk=2, page_size=1),
        "--speculative-num-steps must be >= 1",
    ),
    (
        dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=0, page_size=1),
        "--speculative-eagle-topk must be >= 1",
    ),
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=1,
            page_size=1,
        ),
        "must be >= 2",
    ),
    (
        dict(speculative_algorithm="EAGLE", speculative_eagle_topk=2, page_size=1),
        "--speculative-num-steps must be given",
    ),
    (dict(speculative_algorithm="EAGLE", page_size=3), "--page-size must be a power of two"),
    (dict(speculative_algorithm=None, page_size=2048), "--page-size must be a power of two"),
    (
        dict(speculative_algorithm="EAGLE3", page_size=1, speculative_draft_model_path=None),
        "needs --speculative-draft-model-path",
    ),
    (dict(speculative_algorithm=None, speculative_num_steps=3, page_size=1), "needs --speculative-algorithm"),
    (
        dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            page_size=1,
            speculative_debug_fixed_accept_len=9,
        ),
        "--speculative-debug-fixed-accept-len",
    ),
]


@pytest.mark.parametrize("kw,message", REFUSALS)
def test_refusals(kw, message):
    with pytest.raises(ArgumentError, match=message.replace("-", r"\-").replace("(", r"\(")):
        resolve_speculative(args(**kw))


def test_refusal_names_the_allowed_backends():
    with pytest.raises(ArgumentError) as err:
        resolve_speculative(
            args(
                speculative_algorithm="EAGLE3",
                speculative_num_steps=5,
                speculative_eagle_topk=8,
                speculative_num_draft_tokens=32,
                page_size=64,
                attention_backend="sdpa",
            )
        )
    allowed = paged_tree_backends()
    assert set(allowed) == {"torch_native", "triton"}  # derived from each class's capability flag
    for name in allowed:
        assert name in str(err.value)


def test_no_speculation_is_spec_v0():
    a = resolve_speculative(ServerArgs(page_size=64))
    assert a.spec_version == 0 and a.speculative_algorithm is None
