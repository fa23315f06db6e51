"""The draft heads shipped for the embedded SmolLM2: released layouts, and real acceptance through the Engine."""

from __future__ import annotations

import os

import pytest
import torch
from make_eagle_data import heldout_questions
from safetensors.torch import load_file

from treepage.entrypoints.engine import Engine
from treepage.managers.tokenizer import apply_chat_template
from treepage.models.eagle_checkpoint import hot_ids_from_d2t
from treepage.models.loader import default_model_path, load_config
from treepage.models.shipped_heads import SHIPPED_HEADS, shipped_head_path
from treepage.server_args import ServerArgs


@pytest.mark.parametrize("algorithm", sorted(SHIPPED_HEADS))
def test_shipped_heads_are_small_released_layouts(algorithm):
    path = shipped_head_path(algorithm.lower())
    assert sorted(os.listdir(path)) == [
        "config.json",
        "model.safetensors",
    ]  # no tokenizer: the target's is used
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 32 * 2**20
    cfg, target = load_config(path), load_config(default_model_path())
    want = {"EAGLE3": "LlamaForCausalLMEagle3", "EAGLE": "LlamaForCausalLMEagle"}[algorithm]
    assert cfg.architecture == want and cfg.num_hidden_layers == 1 and cfg.hidden_size == target.hidden_size
    state = load_file(os.path.join(path, "model.safetensors"))  # as stored, before any cast
    assert all(t.dtype == torch.bfloat16 for t in state.values() if t.is_floating_point())
    if algorithm == "EAGLE3":
        Vd = cfg.hf_config["draft_vocab_size"]
        hot = hot_ids_from_d2t(state["d2t"])
        assert state["lm_head.weight"].shape == (Vd, cfg.hidden_size) and Vd < target.vocab_size
        assert torch.equal(torch.nonzero(state["t2d"]).flatten(), hot)
    else:
        assert "lm_head.weight" not in state and state["fc.weight"].shape == (
            cfg.hidden_size,
            2 * cfg.hidden_size,
        )


def test_shipped_head_path_rejects_unknown_algorithms():
    with pytest.raises(ValueError, match="EAGLE3"):
        shipped_head_path("MEDUSA")


SP = {"temperature": 0, "max_new_tokens": 128}

# None: the default server's configuration (no speculative flags at all); else (algorithm, S, K, N)
CONFIGS = [None, ("EAGLE3", 5, 8, 32), ("EAGLE", 5, 8, 64)]


@pytest.fixture(scope="module")
def plain_reference() -> tuple[list[int], list[int]]:
    plain_args = ServerArgs(dtype="float32", page_size=64, log_level="warning", speculative_algorithm="NONE")
    with Engine(plain_args) as plain:
        assert plain.avg_spec_accept_length() == 0.0 and not plain.args.speculation
        ids = apply_chat_template(plain.tokenizer, [{"role": "user", "content": heldout_questions(1)[0]}])
        return ids, plain.generate(input_ids=ids, sampling_params=SP)["output_ids"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "default" if c is None else "{}-{}-{}-{}".format(*c)
)
def test_shipped_head_decodes_exactly_with_real_acceptance(plain_reference, config):
    """A held-out prompt, greedy, 128 tokens, page size 64; float32 so that greedy equality is exact arithmetic."""
    ids, want = plain_reference
    if config is None:
        args = ServerArgs(dtype="float32", log_level="warning")
    else:
        algo, S, K, N = config
        args = ServerArgs(
            dtype="float32",
            page_size=64,
            log_level="warning",
            speculative_algorithm=algo,
            speculative_draft_model_path=shipped_head_path(algo),
            speculative_num_steps=S,
            speculative_eagle_topk=K,
            speculative_num_draft_tokens=N,
        )
    with Engine(args) as spec:
        a = spec.args
        if (
            config is None
        ):  # the default server: EAGLE-3, shipped head, a topk-4 tree on 64-token pages, spec v2
            got_cfg = (a.speculative_algorithm, a.speculative_num_steps, a.speculative_eagle_topk)
            assert got_cfg + (a.speculative_num_draft_tokens, a.page_size, a.spec_version) == (
                "EAGLE3",
                4,
                4,
                16,
                64,
                2,
            )
            assert a.speculative_draft_model_path == shipped_head_path("EAGLE3")
        got = spec.generate(input_ids=ids, sampling_params=SP)["output_ids"]
        accept = spec.avg_spec_accept_length()
        spec.wait_idle()
        mem = spec.memory_report()
    assert len(want) > 32 and got == want
    assert accept > 1.5, f"average accept length {accept:.2f}"
    assert mem["used_pages"] == 0 and mem["used_rows"] == 0
