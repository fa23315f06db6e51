"""Train an EAGLE-3 or EAGLE draft head for the target on the data of make_eagle_data.py.

Why this recipe (see docs/training.md):
- Features come from one teacher-forced pass of the frozen target (transformers' Llama with our loaded weights):
  EAGLE-3 fuses the residual stream at the inputs of the default aux layers, EAGLE uses the final-norm output.
  They are cached once per data set, so the second head trains without another target pass.
- EAGLE-3: training-time test. The head is unrolled `--ttt-steps` times; step k feeds its own pre-norm state
  back, reads the token k positions further on, sees step-0 keys causally plus its own chain (a diagonal per
  earlier step) and uses RoPE position t + k, which is exactly what a draft chain sees at inference. Loss =
  soft cross-entropy to the target distribution renormalized over the draft vocabulary, weighted 0.8^k.
- EAGLE: smooth-L1 regression to the next target feature + 0.1 x token loss through the frozen target LM
  head, over the same unroll (so deeper drafts have seen their own states in training).
- Warm start from a late target layer (eagle_head_from_target); the released layouts are written in bf16.
  `--init-head` starts an EAGLE-3 head from a trained one instead, its draft vocabulary widened to
  --draft-vocab-size by the most frequent other response tokens (new LM-head rows: the target's).

Resumable: a checkpoint is written every --ckpt-every steps to --work; --resume continues bit-exactly, also after
--max-minutes ended a run early (evaluated and saved at the step it reached).

    python scripts/train_eagle.py --algorithm EAGLE3 --data build/eagle
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from treepage.arg_groups import dtype_choice
from treepage.layers.norm import RMSNorm
from treepage.layers.rope import RotaryEmbedding
from treepage.models.config import ModelConfig
from treepage.models.eagle_checkpoint import (
    draft_vocab_maps,
    eagle_head_from_target,
    hot_ids_from_counts,
    hot_ids_from_d2t,
    save_eagle_head,
)
from treepage.models.llama import LlamaMLP, default_aux_layers
from treepage.models.loader import default_model_path, load_config, load_state_dict
from treepage.server_args import ServerArgs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = {
    "EAGLE3": os.path.join(REPO, "python", "treepage", "data", "heads", "smollm2-eagle3"),
    "EAGLE": os.path.join(REPO, "python", "treepage", "data", "heads", "smollm2-eagle"),
}
DEFAULT_PNG = {"EAGLE3": "docs/eagle3_loss.png", "EAGLE": "docs/eagle_loss.png"}
EXTRA_HELDOUT = ("heldout_old",)  # further held-out domains, evaluated (never trained on) when present


# ------------------------------------------------------------------------------------------------ head modules
class Attention(nn.Module):
    """Released projection names; the attention itself is the dense training-time-test form (ttt_attention)."""

    def __init__(self, cfg: ModelConfig, in_features: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_features, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_features, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: RotaryEmbedding, cache: list) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B * T, self.nh, self.hd)
        k = self.k_proj(x).view(B * T, self.nkv, self.hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd)
        q, k = rope(pos.reshape(-1), q, k)
        cache.append((k.view(B, T, self.nkv, self.hd), v))
        o = ttt_attention(q.view(B, T, self.nh, self.hd), cache, self.hd**-0.5)
        return self.o_proj(o.reshape(B, T, -1))


def ttt_attention(q: torch.Tensor, cache: list, scale: float) -> torch.Tensor:
    """q [B, T, nh, d] of unroll step k = len(cache) - 1. Row t attends to the step-0 keys of rows <= t
    (causal) and, for every later step j <= k, to the key of its own row only (its draft chain)."""
    B, T, nh, d = q.shape
    rep = nh // cache[0][0].shape[2]
    k0, v0 = (x.repeat_interleave(rep, dim=2) for x in cache[0])
    s0 = torch.einsum("bqhd,bkhd->bhqk", q, k0) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [
        (q * kj.repeat_interleave(rep, dim=2)).sum(-1).transpose(1, 2)[..., None] * scale
        for kj, _ in cache[1:]
    ]
    p = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    o = torch.einsum("bhqk,bkhd->bqhd", p[..., :T], v0)
    for j, (_, vj) in enumerate(cache[1:]):
        o = o + p[..., T + j].transpose(1, 2)[..., None] * vj.repeat_interleave(rep, dim=2)
    return o


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg, 2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = LlamaMLP(H, cfg.intermediate_size)


class Eagle1Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TrainHead(nn.Module):
    """Training form of LlamaForCausalLMEagle3 / LlamaForCausalLMEagle: state_dict() keys are the released
    tensor names (d2t/t2d excepted), so it loads and saves the released layout directly."""

    def __init__(self, cfg: ModelConfig, algorithm: str, embed: nn.Embedding, max_position: int) -> None:
        super().__init__()
        self.algorithm, self.cfg = algorithm, cfg
        H = cfg.hidden_size
        self.rope = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self._embed = [embed]  # frozen target embedding, kept out of state_dict / parameters
        if algorithm == "EAGLE3":
            d = cfg.hf_config
            self.fc = nn.Linear(
                int(d.get("num_aux_hidden_states") or 3) * H, H, bias=bool(d.get("bias", False))
            )
            self.midlayer = Eagle3Layer(cfg)
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(H, int(d["draft_vocab_size"]), bias=False)
        else:
            self.fc = nn.Linear(2 * H, H, bias=bool(cfg.hf_config.get("bias", True)))
            self.layers = nn.ModuleList([Eagle1Layer(cfg)])

    def unroll(self, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """feats [B, T, F]: target features of rows t; tokens [B, T]: x_{t+1} at row t (0-padded). Returns the
        recurrent state h2 [B, T, H] of every unroll step; step k row t drafts position t + k + 1."""
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device).expand(B, T)
        cache: list = []
        outs: list[torch.Tensor] = []
        g = feats
        for k in range(steps):
            tok = F.pad(tokens[:, k:], (0, k)) if k else tokens
            with torch.no_grad():
                e = self._embed[0](tok)
            if self.algorithm == "EAGLE3":
                if k == 0:
                    g = self.fc(g)  # target features are fused once; own states skip fc
                m = self.midlayer
                u = torch.cat([m.input_layernorm(e), m.hidden_norm(g)], dim=-1)
                h = g + m.self_attn(u, pos + k, self.rope, cache)
                h = h + m.mlp(m.post_attention_layernorm(h))
            else:
                layer = self.layers[0]
                z = self.fc(torch.cat([e.to(g.dtype), g], dim=-1))
                h = z + layer.self_attn(z, pos + k, self.rope, cache)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            outs.append(h)
            g = h
        return outs


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Split:
    ids: list[torch.Tensor]  # full sequence (prompt + response) per record
    plen: list[int]  # prompt length per record
    offsets: list[int]  # start row of each record in the feature tensors
    aux: torch.Tensor | None = None  # [N_tok, 3H]
    last: torch.Tensor | None = None  # [N_tok, H]

    @property
    def tokens(self) -> int:
        """N_tok: the rows of the feature tensors."""
        return sum(len(s) for s in self.ids)


def read_split(path: str, limit: int | None) -> Split:
    ids, plen, offsets, n = [], [], [], 0
    with open(path) as f:
        for line in f:
            if limit is not None and len(ids) >= limit:
                break
            r = json.loads(line)
            seq = r["input_ids"] + r["output_ids"]
            ids.append(torch.tensor(seq, dtype=torch.long))
            plen.append(len(r["input_ids"]))
            offsets.append(n)
            n += len(seq)
    return Split(ids, plen, offsets)


def build_hf_target(model_path: str, dtype: torch.dtype):
    """transformers' Llama carrying our loaded weights (GGUF dequantized): its hidden_states[i] is the input of
    layer i and hidden_states[-1] the final-norm output, exactly the features the engine captures."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = load_config(model_path)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict()))
    state = load_state_dict(model_path, progress=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"target weights do not fit transformers' Llama: {missing=} {unexpected=}")
    model.tie_weights()
    return model.to(dtype).eval(), cfg, state


def feature_columns(cfg: ModelConfig) -> dict[str, int]:
    """Values per token of each kind of feature: the three captured layer inputs side by side (EAGLE-3's "aux")
    and the final-norm output (EAGLE's "last")."""
    H = cfg.hidden_size
    return {"aux": len(default_aux_layers(cfg.num_hidden_layers)) * H, "last": H}


def feature_file(path: str, rows: int, cols: int, dtype: torch.dtype, write: bool) -> torch.Tensor:
    """A [rows, cols] tensor memory-mapped onto a raw file (created at its full size when `write`): the page cache
    holds the features, not the process heap, so a data set whose features exceed RAM still trains, and a batch
    reads only its own rows. Written through a shared mapping; read through a private one (copy on write)."""
    if write:
        with open(path, "wb") as f:
            f.truncate(rows * cols * dtype.itemsize)
    return torch.from_file(path, shared=write, size=rows * cols, dtype=dtype).view(rows, cols)


@torch.no_grad()
def extract_features(
    hf, cfg: ModelConfig, split: Split, batch_tokens: int, device: str, desc: str, prefix: str | None = None
) -> None:
    """The target's features of every row of `split`, into split.aux / split.last: in memory, or with `prefix`
    into the files `<prefix>.aux` and `<prefix>.last` (feature_file)."""
    aux_ids = default_aux_layers(cfg.num_hidden_layers)
    n = split.tokens
    dtype, cols = next(hf.parameters()).dtype, feature_columns(cfg)

    def alloc(kind: str) -> torch.Tensor:
        if prefix is None:
            return torch.empty(n, cols[kind], dtype=dtype)
        return feature_file(f"{prefix}.{kind}", n, cols[kind], dtype, True)

    split.aux, split.last = alloc("aux"), alloc("last")
    order = sorted(range(len(split.ids)), key=lambda i: len(split.ids[i]))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(split.ids[i]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    batches += [cur] if cur else []
    for b in tqdm(batches, desc=desc, unit="batch"):
        T = max(len(split.ids[i]) for i in b)
        ids = torch.zeros(len(b), T, dtype=torch.long)
        mask = torch.zeros(len(b), T, dtype=torch.long)
        for r, i in enumerate(b):
            ids[r, : len(split.ids[i])] = split.ids[i]
            mask[r, : len(split.ids[i])] = 1
        out = hf.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[j] for j in aux_ids], dim=-1).cpu()
        last = out.last_hidden_state.cpu()
        for r, i in enumerate(b):
            o, L = split.offsets[i], len(split.ids[i])
            split.aux[o : o + L] = aux[r, :L]
            split.last[o : o + L] = last[r, :L]


def load_or_extract(args, model_path: str, splits: dict[str, Split], device: str) -> ModelConfig:
    """Features of every split, cached in --work under a key of the data and the target: one folder of raw
    memory-mapped files (feature_file) per key, complete once its meta.json exists (written last)."""
    h = hashlib.sha256(f"{model_path}|{args.feature_dtype}|{args.limit}".encode())
    for name in splits:
        with open(os.path.join(args.data, f"{name}.jsonl"), "rb") as f:
            h.update(f.read())
    folder = os.path.join(args.work, f"features-{h.hexdigest()[:16]}")
    meta_path = os.path.join(folder, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        dtype = getattr(torch, meta["dtype"])
        for name, s in splits.items():
            for kind in ("aux", "last"):
                path = os.path.join(folder, f"{name}.{kind}")
                setattr(s, kind, feature_file(path, s.tokens, meta[kind], dtype, False))
        return load_config(model_path)
    t0 = time.time()
    os.makedirs(folder, exist_ok=True)
    hf, cfg, _ = build_hf_target(model_path, getattr(torch, args.feature_dtype))
    hf.to(device)
    for name, s in splits.items():
        prefix = os.path.join(folder, name)
        extract_features(hf, cfg, s, args.feature_batch_tokens, device, f"target features ({name})", prefix)
    del hf
    meta = {"dtype": args.feature_dtype, **feature_columns(cfg)}
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + ".tmp", meta_path)
    print(f"features: {time.time() - t0:.0f}s -> {folder}")
    return cfg


def batch_schedule(split: Split, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Deterministic batches for the whole run: per epoch, shuffle, sort chunks by length (less padding)."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < steps:
        idx = list(range(len(split.ids)))
        rng.shuffle(idx)
        chunk = 8 * batch_size
        epoch = []
        for c in range(0, len(idx), chunk):
            part = sorted(idx[c : c + chunk], key=lambda i: len(split.ids[i]))
            epoch += [part[j : j + batch_size] for j in range(0, len(part), batch_size)]
        rng.shuffle(epoch)
        out += epoch
    return out[:steps]


def collate(split: Split, rows: list[int], algorithm: str, device: str):
    T = max(len(split.ids[i]) for i in rows)
    B = len(rows)
    src = split.aux if algorithm == "EAGLE3" else split.last
    ids = torch.zeros(B, T, dtype=torch.long)
    feats = torch.zeros(B, T, src.shape[1], dtype=src.dtype)
    last = torch.zeros(B, T, split.last.shape[1], dtype=split.last.dtype)
    label = torch.zeros(B, T, dtype=torch.bool)  # position p predicts a response token x_{p+1}
    for r, i in enumerate(rows):
        L, o = len(split.ids[i]), split.offsets[i]
        ids[r, :L] = split.ids[i]
        feats[r, :L] = src[o : o + L]
        last[r, :L] = split.last[o : o + L]
        label[r, split.plen[i] - 1 : L - 1] = True
    return ids.to(device), feats.to(device), last.to(device), label.to(device)


def widened_head_state(
    fresh: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], hot: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A trained EAGLE-3 head's tensors on the draft vocabulary `hot`, a superset of its own (hot_ids_from_counts
    with keep=): every tensor as trained except the LM head, whose rows of the trained vocabulary are kept and
    whose new rows start as in `fresh` (eagle_head_from_target: the target's LM-head rows)."""
    out = dict(fresh)
    for name, t in trained.items():
        if name in ("lm_head.weight", "d2t", "t2d"):
            continue
        if name not in fresh or fresh[name].shape != t.shape:
            raise ValueError(f"--init-head: tensor {name} {tuple(t.shape)} does not fit this head")
        out[name] = t.float()
    lm = fresh["lm_head.weight"].clone()
    lm[torch.searchsorted(hot, hot_ids_from_d2t(trained["d2t"]))] = trained["lm_head.weight"].float()
    out["lm_head.weight"] = lm
    return out


# ------------------------------------------------------------------------------------------------ loss
def batch_loss(head: TrainHead, batch, hot: torch.Tensor, w_hot: torch.Tensor, args, noise_scale: float):
    """Returns (total loss, per-step loss list, per-step top-1 agreement list)."""
    ids, feats, last, label = batch
    B, T = ids.shape
    in_hot = torch.zeros(head.cfg.vocab_size, dtype=torch.bool, device=ids.device)
    in_hot[hot] = True
    tokens = F.pad(ids[:, 1:], (0, 1))  # row t reads x_{t+1}
    # Target distribution at every labelled position p, renormalized over the draft vocabulary.
    nxt = F.pad(ids[:, 1:], (0, 1))
    keep = label & in_hot[nxt]
    with torch.no_grad():
        tgt_logp = torch.log_softmax(last[keep].float() @ w_hot.T, dim=-1)
    index = torch.full((B, T), -1, dtype=torch.long, device=ids.device)
    index[keep] = torch.arange(int(keep.sum()), device=ids.device)
    x = feats.float()
    if noise_scale > 0:
        x = x + (torch.rand_like(x) - 0.5) * 2 * noise_scale
    ctx = (
        torch.autocast(ids.device.type, dtype=torch.bfloat16)
        if args.autocast
        else torch.autocast(ids.device.type, enabled=False)
    )
    with ctx:
        states = head.unroll(x, tokens, args.ttt_steps)
    total, losses, accs = 0.0, [], []
    for k, h in enumerate(states):
        idx = F.pad(index[:, 1 + k :], (0, 1 + k), value=-1)  # row t at step k predicts at position t+1+k
        m = idx >= 0
        if not m.any():
            losses.append(0.0)
            accs.append(0.0)
            continue
        t_logp = tgt_logp[idx[m]]
        hm = h[m].float()
        if head.algorithm == "EAGLE3":
            logits = head.lm_head(head.norm(hm))
        else:
            logits = hm @ w_hot.T
        logp = torch.log_softmax(logits.float(), dim=-1)
        cls = -(t_logp.exp() * logp).sum(-1).mean()
        if head.algorithm == "EAGLE3":
            step_loss = cls
        else:
            target_f = F.pad(last[:, 1 + k :], (0, 0, 0, 1 + k))[m].float()
            reg = F.smooth_l1_loss(hm, target_f)
            step_loss = reg + args.token_weight * cls
        total = total + args.step_decay**k * step_loss
        losses.append(float(step_loss.detach()))
        accs.append(float((logp.argmax(-1) == t_logp.argmax(-1)).float().mean()))
    return total, losses, accs


@torch.no_grad()
def evaluate(head, split, hot, w_hot, args, device) -> dict:
    losses, accs, n = [0.0] * args.ttt_steps, [0.0] * args.ttt_steps, 0
    head.eval()
    order = sorted(range(len(split.ids)), key=lambda i: len(split.ids[i]))
    for c in range(0, len(order), args.batch_size):
        rows = order[c : c + args.batch_size]
        _, ls, acs = batch_loss(head, collate(split, rows, head.algorithm, device), hot, w_hot, args, 0.0)
        losses = [a + b for a, b in zip(losses, ls)]
        accs = [a + b for a, b in zip(accs, acs)]
        n += 1
    head.train()
    return {"loss": [round(x / n, 4) for x in losses], "acc": [round(x / n, 4) for x in accs]}


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def plot(history: dict, path: str, title: str, decay: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h[0] for h in history["train"]]
    loss = [h[1] for h in history["train"]]
    ema, smooth = loss[0] if loss else 0.0, []
    for x in loss:
        ema = 0.95 * ema + 0.05 * x
        smooth.append(ema)
    a.plot(steps, loss, alpha=0.3, label="train loss (batch)")
    a.plot(steps, smooth, label="train loss (EMA)")
    if history["eval"]:
        weighted = [sum(decay**k * x for k, x in enumerate(e["loss"])) for e in history["eval"]]
        a.plot([e["step"] for e in history["eval"]], weighted, "o-", label="held-out loss")
        K = len(history["eval"][0]["acc"])
        for k in range(K):
            line = b.plot([e["step"] for e in history["eval"]], [e["acc"][k] for e in history["eval"]], "o-",
                          label=f"unroll step {k}")  # fmt: skip
            for name in (n for n in history["eval"][-1] if n not in ("step", "loss", "acc")):
                b.plot([e["step"] for e in history["eval"] if name in e],
                       [e[name]["acc"][k] for e in history["eval"] if name in e], "x--",
                       color=line[0].get_color(), label=f"step {k}, {name}")  # fmt: skip
    a.set_xlabel("optimizer step")
    a.set_title(f"{title}: loss = sum over unroll steps k of {decay}^k loss_k")
    a.legend()
    b.set_xlabel("optimizer step")
    b.set_title(f"{title}: held-out top-1 agreement with the target")
    b.legend(fontsize=7, ncol=2)
    b.set_ylim(0, 1)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", choices=("EAGLE3", "EAGLE"), required=True)
    ap.add_argument("--data", default="build/eagle")
    ap.add_argument("--heldout", default="heldout", help="held-out split scored as 'held-out' (file stem)")
    ap.add_argument("--work", default=None, help="features cache, checkpoints (default: under --data)")
    ap.add_argument("--out", default=None, help="head directory (default: the package's shipped head)")
    ap.add_argument("--loss-png", default=None, help="default: docs/ for the shipped head, else <out>-loss.png")
    ap.add_argument("--model-path", default=None, help="target (default: the embedded SmolLM2 GGUF)")
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: EAGLE3 900, EAGLE 500)"
    )
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--ttt-steps", type=int, default=None, help="unroll length (default: EAGLE3 5, EAGLE 3)")
    ap.add_argument("--step-decay", type=float, default=0.8, help="weight 0.8^k of unroll step k")
    ap.add_argument("--token-weight", type=float, default=0.1, help="EAGLE: weight of the token loss")
    ap.add_argument("--noise", type=float, default=0.0, help="uniform input-feature noise, x feature std")
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument(
        "--init-head",
        default=None,
        help="EAGLE-3: start from this trained head, its draft vocabulary widened to --draft-vocab-size",
    )
    ap.add_argument("--init-layer", type=int, default=None, help="target layer copied at init (default last)")
    ap.add_argument("--branch-init-scale", type=float, default=0.0, help="EAGLE: scale of copied o/down_proj")
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 matmuls (default: where bf16 is native, as --dtype auto decides)",
    )
    ap.add_argument("--feature-dtype", default="auto", help="the target pass dtype (auto: bf16 if native)")
    ap.add_argument("--feature-batch-tokens", type=int, default=4096)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop training (evaluated, saved, resumable) once this much wall time has passed since start",
    )
    ap.add_argument("--limit", type=int, default=None, help="use only the first N records of each split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    eagle3 = args.algorithm == "EAGLE3"
    if args.init_head and not eagle3:
        ap.error("--init-head: EAGLE-3 heads only")
    args.steps = args.steps or (900 if eagle3 else 500)
    args.ttt_steps = args.ttt_steps or (5 if eagle3 else 3)
    args.work = args.work or os.path.join(args.data, "work")
    # the curve in docs/ belongs to the shipped head: a head written elsewhere gets its curve beside it
    default_png = os.path.join(REPO, DEFAULT_PNG[args.algorithm]) if args.out is None else None
    args.out = args.out or DEFAULT_OUT[args.algorithm]
    args.loss_png = args.loss_png or default_png or args.out.rstrip("/") + "-loss.png"
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 on CUDA and on CPUs that compute it natively, else fp32: emulated bf16 matmuls run several times
    # slower than fp32, and the engine's bf16 kernels for such CPUs serve neither transformers nor autograd.
    auto = dtype_choice(ServerArgs(dtype="auto"), args.device, treepage_kernels=False).dtype
    if args.feature_dtype == "auto":
        args.feature_dtype = str(auto).removeprefix("torch.")
    if args.autocast is None:
        args.autocast = auto == torch.bfloat16
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.work, exist_ok=True)
    device = args.device
    model_path = args.model_path or default_model_path()
    t_start = time.time()

    names = ["train", args.heldout] + [
        s
        for s in ("heldout", *EXTRA_HELDOUT)
        if s != args.heldout and os.path.exists(os.path.join(args.data, f"{s}.jsonl"))
    ]
    splits = {s: read_split(os.path.join(args.data, f"{s}.jsonl"), args.limit) for s in names}
    tcfg = load_or_extract(args, model_path, splits, device)
    train, held = splits["train"], splits[args.heldout]
    extra = {s: splits[s] for s in names[2:]}
    t_features = time.time() - t_start

    # Draft vocabulary: the most frequent target tokens of the training responses.
    counts = torch.zeros(tcfg.vocab_size, dtype=torch.long)
    for seq, p in zip(train.ids, train.plen):
        counts += torch.bincount(seq[p:], minlength=tcfg.vocab_size)
    Vd = min(args.draft_vocab_size, tcfg.vocab_size)
    trained = load_state_dict(args.init_head, progress=False) if args.init_head else None
    hot = hot_ids_from_counts(counts, Vd, keep=None if trained is None else hot_ids_from_d2t(trained["d2t"]))
    in_hot = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
    in_hot[hot] = True
    coverage = {"train": float(counts[hot].sum() / counts.sum())}  # the held-out splits' own, below
    for name, split in ({args.heldout: held} | extra).items():
        resp = torch.cat([s[p:] for s, p in zip(split.ids, split.plen)])
        coverage[name] = float(in_hot[resp].float().mean())

    tstate = load_state_dict(model_path, progress=False)
    cfg_d, init = eagle_head_from_target(
        tstate,
        tcfg,
        args.algorithm,
        Vd if args.algorithm == "EAGLE3" else None,
        hot if args.algorithm == "EAGLE3" else None,
        args.init_layer,
    )
    if trained is not None:
        init = widened_head_state(init, trained, hot)
    if args.algorithm == "EAGLE":
        # EAGLE's layer has no input norm and feeds its raw output back: a copied late layer writes residual-
        # stream-sized updates (massive activations) that explode over the unroll. Start its residual branches
        # at zero instead, i.e. as the identity on the feature; the copied projections still seed the rest.
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            init[name] = init[name] * args.branch_init_scale
    hcfg = ModelConfig.from_hf_dict(cfg_d)
    embed = nn.Embedding(tcfg.vocab_size, tcfg.hidden_size).to(device)
    embed.weight.data.copy_(tstate["model.embed_tokens.weight"])
    embed.weight.requires_grad_(False)
    lm = tstate.get("lm_head.weight", tstate["model.embed_tokens.weight"])
    w_hot = lm[hot].float().to(device)  # target LM-head rows of the draft vocabulary (frozen)
    hot = hot.to(device)
    max_len = max(len(s) for split in splits.values() for s in split.ids)
    head = TrainHead(hcfg, args.algorithm, embed, max_len + args.ttt_steps + 1).to(device)
    head.load_state_dict({n: t for n, t in init.items() if n not in ("d2t", "t2d")})
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    feat_std = float((train.aux if args.algorithm == "EAGLE3" else train.last)[:100000].float().std())
    noise_scale = args.noise * feat_std

    ckpt = os.path.join(args.work, f"ckpt-{args.algorithm}.pt")
    history: dict = {"train": [], "eval": []}
    step = 0
    if args.resume and os.path.exists(ckpt):
        c = torch.load(ckpt, weights_only=False)
        head.load_state_dict(c["head"])
        opt.load_state_dict(c["opt"])
        step, history = c["step"], c["history"]
        torch.set_rng_state(c["rng"])
        print(f"resumed {args.algorithm} at step {step}")
    schedule = batch_schedule(train, args.batch_size, args.steps, args.seed)

    def save_ckpt() -> None:
        c = {"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history}
        torch.save(c | {"rng": torch.get_rng_state()}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)

    t_train = time.time()
    head.train()

    def run_eval() -> None:
        history["eval"].append({"step": step, **evaluate(head, held, hot, w_hot, args, device)})
        for name, split in extra.items():
            history["eval"][-1][name] = evaluate(head, split, hot, w_hot, args, device)
        tqdm.write(f"step {step}: held-out {history['eval'][-1]}")

    if step == 0:
        run_eval()
    bar = tqdm(total=args.steps, initial=step, desc=f"train {args.algorithm}", unit="step", mininterval=5)
    stopped_early = False
    while step < args.steps:
        if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
            stopped_early = True
            run_eval()
            save_ckpt()
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        batch = collate(train, schedule[step], args.algorithm, device)
        loss, losses, accs = batch_loss(head, batch, hot, w_hot, args, noise_scale)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        step += 1
        loss_value = float(loss.detach())
        history["train"].append((step, loss_value, accs))
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", acc0=f"{accs[0]:.2f}", accL=f"{accs[-1]:.2f}")
        if step % args.eval_every == 0 or step == args.steps:
            run_eval()
        if step % args.ckpt_every == 0 or step == args.steps:
            save_ckpt()
    bar.close()
    train_s = time.time() - t_train

    state = {n: t.detach().cpu() for n, t in head.state_dict().items()}
    if args.algorithm == "EAGLE3":
        state["d2t"], state["t2d"] = draft_vocab_maps(hot.cpu(), tcfg.vocab_size)
    if os.path.isdir(args.out):
        for f in ("model.safetensors", "pytorch_model.bin"):
            if os.path.exists(os.path.join(args.out, f)):
                os.remove(os.path.join(args.out, f))
    save_eagle_head(args.out, cfg_d, state, dtype=torch.bfloat16)
    plot(history, args.loss_png, args.algorithm, args.step_decay)
    summary = {
        "algorithm": args.algorithm,
        "train_records": len(train.ids),
        "train_tokens": train.tokens,
        "train_response_tokens": int(counts.sum()),
        "heldout_records": {name: len(split.ids) for name, split in ({args.heldout: held} | extra).items()},
        "draft_vocab_size": Vd,
        "draft_vocab_coverage": {k: round(v, 4) for k, v in coverage.items()},
        "steps": args.steps,
        "steps_done": step,
        "stopped_early": stopped_early,
        "feature_s": round(t_features, 1),
        "train_s_this_run": round(train_s, 1),
        "final_eval": history["eval"][-1] if history["eval"] else None,
        "head_bytes": os.path.getsize(os.path.join(args.out, "model.safetensors")),
        "args": {k: v for k, v in vars(args).items()},
    }
    with open(os.path.join(args.work, f"summary-{args.algorithm}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "args"}, indent=2))
    return summary


if __name__ == "__main__":
    main()
