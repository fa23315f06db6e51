"""scripts/train_eagle.py: the training forward equals the inference heads, features equal the engine's capture,
and a run resumes bit-exactly into a head the engine's loader accepts."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import train_eagle as te
from safetensors.torch import load_file

from spec_utils import random_eagle_head
from treepage.layers.attention.torch_native_backend import TorchNativeAttnBackend
from treepage.layers.forward_batch import CaptureHidden, ForwardBatch, ForwardMode
from treepage.mem_cache.memory_pool import KVPool
from treepage.models.config import ModelConfig
from treepage.models.eagle_checkpoint import hot_ids_from_d2t
from treepage.models.llama import LlamaForCausalLM
from treepage.models.llama_eagle import LlamaForCausalLMEagle
from treepage.models.llama_eagle3 import LlamaForCausalLMEagle3
from treepage.models.loader import load_config, load_state_dict, load_weights_into

MAX_POS = 64


def run_extend(model, pool: KVPool, ids: torch.Tensor, hidden, start: int, capture=CaptureHidden.NONE):
    """One request at page size 1 (position i in slot i + 1): an EXTEND forward through the engine's path."""
    T = ids.shape[0]
    backend = TorchNativeAttnBackend()
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids,
        positions=torch.arange(start, start + T),
        out_cache_loc=torch.arange(start + 1, start + T + 1),
        req_rows=torch.tensor([0]),
        req_to_token=torch.arange(1, MAX_POS + 1, dtype=torch.int64)[None],
        kv_pool=pool,
        attn_backend=backend,
        page_size=1,
        prefix_lens=[start],
        extend_lens=[T],
        input_hidden=hidden,
        capture_hidden=capture,
    )
    backend.init_forward_metadata(fb)
    with torch.no_grad():
        out = model(fb)
    return out.hidden if capture == CaptureHidden.NONE else out.features


def load_target(path: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(load_config(path), MAX_POS)
    load_weights_into(model, load_state_dict(path, progress=False))
    return model.eval()


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_unroll_equals_inference_head_through_engine_path(tiny_llama3_dir, algorithm):
    target = load_target(tiny_llama3_dir)
    cfg_d, S = random_eagle_head(
        target.config, algorithm, draft_vocab_size=48 if algorithm == "EAGLE3" else None
    )
    cfg = ModelConfig.from_hf_dict(cfg_d)  # the target's llama3 rope scaling travels into the head config
    infer = (LlamaForCausalLMEagle3 if algorithm == "EAGLE3" else LlamaForCausalLMEagle)(cfg, MAX_POS)
    infer.load_weights(S)
    infer.bind_target(target)
    train = te.TrainHead(cfg, algorithm, target.model.embed_tokens, MAX_POS)
    train.load_state_dict({n: t for n, t in S.items() if n not in ("d2t", "t2d")})

    T, steps, width = 12, 3, (192 if algorithm == "EAGLE3" else 64)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, T, width, generator=g)
    tokens = torch.randint(0, 128, (1, T), generator=g)
    with torch.no_grad():
        outs = train.unroll(feats, tokens, steps)

    def pool() -> KVPool:
        return KVPool(MAX_POS + 1, 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32)

    def close(a, b):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=1e-4)

    close(outs[0][0], run_extend(infer, pool(), tokens[0], feats[0], 0))  # step 0 = draft extend
    for t in (0, 4, T - steps):
        kv = pool()
        h = run_extend(infer, kv, tokens[0, : t + 1], feats[0, : t + 1], 0)[-1:]
        for k in range(1, steps):  # a draft chain from row t: own state, token t+1+k, position t+k
            h = run_extend(infer, kv, tokens[0, t + k : t + k + 1], h, t + k)
            close(outs[k][0, t], h[0])
    if algorithm == "EAGLE3":
        h = outs[2][0, :4]
        close(train.lm_head(train.norm(h)), infer.compute_logits(h))


def test_features_equal_engine_capture(tiny_llama3_dir):
    target = load_target(tiny_llama3_dir)
    hf, cfg, _ = te.build_hf_target(tiny_llama3_dir, torch.float32)
    ids = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5)]
    split = te.Split(ids, [3, 2], [0, 9])
    te.extract_features(hf, cfg, split, batch_tokens=64, device="cpu", desc="test")  # one padded batch
    for seq, off in zip(ids, split.offsets):
        for kind, capture in (("aux", CaptureHidden.AUX), ("last", CaptureHidden.LAST)):
            kv = KVPool(
                MAX_POS + 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32
            )
            engine_features = run_extend(target, kv, seq, None, 0, capture)
            got = getattr(split, kind)[off : off + len(seq)]
            torch.testing.assert_close(got, engine_features, atol=1e-4, rtol=1e-4)


def test_feature_cache_is_memory_mapped_files_equal_to_the_extraction(tiny_llama3_dir, tmp_path):
    """load_or_extract writes each split's features into raw files that it reads back mapped, not loaded: the same
    values as an in-memory extraction, one file per split and kind of the exact size, complete only with meta.json."""
    write_data(tmp_path)
    args = te.parse_args(["--algorithm", "EAGLE3", "--data", str(tmp_path), "--work", str(tmp_path / "work"),
                          "--feature-dtype", "float32", "--feature-batch-tokens", "64"])  # fmt: skip
    names = ("train", "heldout")
    hf, cfg, _ = te.build_hf_target(tiny_llama3_dir, torch.float32)
    in_memory = {n: te.read_split(str(tmp_path / f"{n}.jsonl"), None) for n in names}
    for n, s in in_memory.items():
        te.extract_features(hf, cfg, s, batch_tokens=64, device="cpu", desc=n)

    def cached() -> dict[str, te.Split]:
        splits = {n: te.read_split(str(tmp_path / f"{n}.jsonl"), None) for n in names}
        te.load_or_extract(args, tiny_llama3_dir, splits, "cpu")
        return splits

    def assert_equal(splits: dict[str, te.Split]) -> None:
        for n in names:
            for kind in ("aux", "last"):
                assert torch.equal(getattr(splits[n], kind), getattr(in_memory[n], kind)), (n, kind)

    assert_equal(cached())
    (folder,) = (tmp_path / "work").iterdir()
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["heldout.aux", "heldout.last", "meta.json", "train.aux", "train.last"]
    rows = sum(len(x) for x in in_memory["train"].ids)
    assert (folder / "train.aux").stat().st_size == rows * 3 * cfg.hidden_size * 4
    assert_equal(cached())
    # the second run read the files: what they hold is what it gets (zeros written over one file show through)
    last = folder / "heldout.last"
    last.write_bytes(bytes(last.stat().st_size))
    assert not cached()["heldout"].last.any()
    # an extraction cut before meta.json leaves an incomplete folder: the next run extracts again
    (folder / "meta.json").unlink()
    assert_equal(cached())


def test_loss_curve_goes_to_docs_only_with_the_shipped_head(tmp_path):
    """docs/eagle3_loss.png is the shipped head's curve: a trial head written elsewhere (--out) draws its own beside
    itself instead of overwriting the one in docs/."""
    shipped = te.parse_args(["--algorithm", "EAGLE3"])
    assert shipped.loss_png == os.path.join(te.REPO, "docs", "eagle3_loss.png")
    trial = te.parse_args(["--algorithm", "EAGLE3", "--out", str(tmp_path / "head") + "/"])
    assert trial.loss_png == str(tmp_path / "head") + "-loss.png"
    named = te.parse_args(["--algorithm", "EAGLE", "--out", str(tmp_path), "--loss-png", "x.png"])
    assert named.loss_png == "x.png"


def write_data(d: pathlib.Path) -> None:
    g = torch.Generator().manual_seed(3)
    for split, n in (("train", 6), ("heldout", 2), ("heldout_old", 2)):
        with open(d / f"{split}.jsonl", "w") as f:
            for i in range(n):
                p = 3 + i % 3
                ids = torch.randint(3, 128, (p + 8 + i,), generator=g).tolist()
                rec = {"id": f"{split}-{i}", "input_ids": ids[:p], "output_ids": ids[p:]}
                f.write(json.dumps(rec) + "\n")


def test_training_resumes_exactly_and_writes_a_loadable_head(tiny_llama3_dir, tmp_path):
    write_data(tmp_path)
    common = ["--algorithm", "EAGLE3", "--data", str(tmp_path), "--model-path", tiny_llama3_dir,
              "--steps", "4", "--batch-size", "2", "--draft-vocab-size", "32", "--ttt-steps", "2",
              "--warmup", "1", "--eval-every", "2", "--ckpt-every", "2", "--no-autocast", "--threads", "1"]  # fmt: skip

    def run(name: str, *extra: str) -> dict:
        return te.main(common + ["--out", str(tmp_path / name), "--loss-png", str(tmp_path / f"{name}.png"),
                                 "--work", str(tmp_path / f"work-{name}"), *extra])  # fmt: skip

    straight = run("a")
    run("b", "--steps", "2")
    run("b", "--resume")
    # A time budget spent before the first step: evaluated, saved, and a resume ends where a straight run does.
    cut = run("c", "--max-minutes", "0")
    assert cut["stopped_early"] and cut["steps_done"] == 0 and cut["final_eval"]["step"] == 0
    assert not straight["stopped_early"] and straight["steps_done"] == 4
    run("c", "--resume")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    c = load_file(tmp_path / "c" / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) and torch.equal(a[n], c[n]) for n in a)
    assert (tmp_path / "a.png").stat().st_size > 0 and straight["final_eval"]["step"] == 4
    assert len(straight["final_eval"]["heldout_old"]["acc"]) == 2  # the second domain is evaluated too
    assert straight["heldout_records"] == {"heldout": 2, "heldout_old": 2}

    # Trained, not initial: the head moved away from the warm start, and the engine's loader takes it.
    cfg = load_config(str(tmp_path / "a"))
    assert cfg.architecture == "LlamaForCausalLMEagle3" and cfg.hf_config["torch_dtype"] == "bfloat16"
    head = LlamaForCausalLMEagle3(cfg, MAX_POS)
    head.load_weights(load_state_dict(str(tmp_path / "a"), progress=False))
    hot = head.map_to_target_ids(torch.arange(32))
    assert torch.all(hot[1:] > hot[:-1]) and torch.equal(torch.nonzero(head.t2d).flatten(), hot)
    resp = torch.cat([torch.tensor(json.loads(r)["output_ids"]) for r in open(tmp_path / "train.jsonl")])
    counts = torch.bincount(resp, minlength=128)
    assert counts[hot].min() >= counts[~head.t2d].max()  # the draft vocabulary is the most frequent ids
    init = te.eagle_head_from_target(
        load_state_dict(tiny_llama3_dir, progress=False), load_config(tiny_llama3_dir), "EAGLE3", 32, hot
    )[1]
    assert not torch.allclose(a["fc.weight"].float(), init["fc.weight"].bfloat16().float())


def test_init_head_keeps_a_trained_head_and_widens_its_vocabulary(tiny_llama3_dir, tmp_path):
    """--init-head: the trained head's tensors and LM-head rows carry over; the new rows are the target's, for
    the most frequent response ids the narrower vocabulary lacked. Stopped before the first step, the written
    head is exactly that start."""
    write_data(tmp_path)
    common = ["--algorithm", "EAGLE3", "--data", str(tmp_path), "--model-path", tiny_llama3_dir,
              "--batch-size", "2", "--ttt-steps", "2", "--warmup", "1", "--no-autocast", "--threads", "1",
              "--work", str(tmp_path / "work")]  # fmt: skip
    narrow, wide = tmp_path / "narrow", tmp_path / "wide"
    te.main(common + ["--out", str(narrow), "--draft-vocab-size", "16", "--steps", "2"])
    summary = te.main(common + ["--out", str(wide), "--draft-vocab-size", "40", "--init-head", str(narrow),
                                "--max-minutes", "0"])  # fmt: skip
    assert summary["steps_done"] == 0 and summary["draft_vocab_size"] == 40
    n, w = load_file(narrow / "model.safetensors"), load_file(wide / "model.safetensors")
    old, new = hot_ids_from_d2t(n["d2t"]), hot_ids_from_d2t(w["d2t"])
    assert torch.isin(old, new).all() and new.numel() == 40
    resp = torch.cat([torch.tensor(json.loads(r)["output_ids"]) for r in open(tmp_path / "train.jsonl")])
    counts = torch.bincount(resp, minlength=128)
    added = new[~torch.isin(new, old)]
    rest = torch.ones(128, dtype=torch.bool)
    rest[new] = False
    assert counts[added].min() >= counts[rest].max()  # the most frequent of the ids the head lacked
    assert all(torch.equal(w[k], n[k]) for k in n if k not in ("lm_head.weight", "d2t", "t2d"))
    rows = torch.searchsorted(new, old)
    assert torch.equal(w["lm_head.weight"][rows], n["lm_head.weight"])
    target_lm = load_state_dict(tiny_llama3_dir, progress=False)
    target_lm = target_lm.get("lm_head.weight", target_lm["model.embed_tokens.weight"])
    fresh = torch.searchsorted(new, added)
    assert torch.equal(w["lm_head.weight"][fresh], target_lm[added].bfloat16())
    with pytest.raises(ValueError, match="cannot keep 40 ids"):
        te.main(common + ["--out", str(tmp_path / "x"), "--draft-vocab-size", "16", "--init-head", str(wide)])
    with pytest.raises(SystemExit):
        te.parse_args(["--algorithm", "EAGLE", "--init-head", str(narrow)])


def test_init_head_refuses_a_head_of_another_shape():
    """--init-head with a head trained for another target (or another head layout) fails naming the tensor,
    instead of loading part of it."""
    hot = torch.arange(4)
    fresh = {"fc.weight": torch.zeros(8, 24), "lm_head.weight": torch.zeros(4, 8)}
    d2t = torch.zeros(2, dtype=torch.long)
    other_width = {"fc.weight": torch.zeros(8, 12), "lm_head.weight": torch.zeros(2, 8), "d2t": d2t}
    with pytest.raises(ValueError, match=r"tensor fc\.weight \(8, 12\) does not fit"):
        te.widened_head_state(fresh, other_width, hot)
    extra = dict(other_width, **{"fc.weight": torch.zeros(8, 24), "midlayer.extra": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"tensor midlayer\.extra \(3,\) does not fit"):
        te.widened_head_state(fresh, extra, hot)
