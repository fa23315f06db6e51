"""Loads a model, owns its KV pool, and runs forwards. The target runner also sizes the shared pools."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from treepage.layers.attention.registry import get_backend_class
from treepage.layers.forward_batch import CaptureHidden, ForwardBatch, ForwardMode
from treepage.mem_cache.allocator import PagedAllocator
from treepage.mem_cache.memory_pool import KVPool, ReqToTokenPool
from treepage.mem_cache.sizing import get_row_width, get_row_width_extra, speculation_enabled
from treepage.models.config import ModelConfig
from treepage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from treepage.models.llama_eagle import LlamaForCausalLMEagle
from treepage.models.llama_eagle3 import LlamaForCausalLMEagle3
from treepage.models.loader import load_config, load_state_dict, load_weights_into
from treepage.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class SharedPools:
    """One allocator and one ReqToTokenPool serve the target and the draft KV pools (docs/design.md)."""

    allocator: PagedAllocator
    req_to_token_pool: ReqToTokenPool
    context_len: int
    row_width: int


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, H]
    logits: torch.Tensor | None  # [rows, V] for fb.logits_indices (all rows when None); None when it is empty
    features: torch.Tensor | None  # [T, F] target features for a draft head, when fb.capture_hidden asks


CausalModel = LlamaForCausalLM | LlamaForCausalLMEagle | LlamaForCausalLMEagle3


def build_model(config: ModelConfig, max_position: int) -> CausalModel:
    arch = config.architecture
    if arch == "LlamaForCausalLMEagle":
        return LlamaForCausalLMEagle(config, max_position)
    if arch == "LlamaForCausalLMEagle3":
        return LlamaForCausalLMEagle3(config, max_position)
    return LlamaForCausalLM(config, max_position)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


@torch.no_grad()
def _init_dummy_weights(model: torch.nn.Module) -> None:
    """Random weights of the right shapes: norms at 1, matrices N(0, 0.02). Index buffers (d2t) stay zero."""
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0) if "norm" in name else p.zero_()
        else:
            p.normal_(0.0, 0.02)


class ModelRunner:
    def __init__(
        self,
        args: ServerArgs,
        model_path: str,
        dtype: torch.dtype,
        pools: SharedPools | None = None,
        config: ModelConfig | None = None,
        draft_bytes_per_token: int = 0,
    ) -> None:
        assert args.page_size and args.attention_backend and args.max_running_requests, "resolve_server_args first"
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = dtype
        self.page_size: int = args.page_size
        self.max_rows: int = args.max_running_requests
        self.config = config or load_config(model_path)
        t0 = time.perf_counter()
        context_len = pools.context_len if pools else self._context_len()
        max_position = get_row_width(context_len, args) + 8
        with torch.device(self.device):
            self.model = build_model(self.config, max_position)
        if args.load_format == "dummy":
            self.model.to(dtype=dtype)
            _init_dummy_weights(self.model)
        else:
            state = load_state_dict(model_path, dtype=torch.float32, device="cpu", progress=True)
            if not isinstance(self.model, LlamaForCausalLM):  # heads map their released tensor names themselves
                self.model.load_weights(state)
            else:
                load_weights_into(self.model, state, strict=True)
        self.model.to(device=self.device, dtype=dtype)
        # RoPE tables stay fp32.
        for m in self.model.modules():
            if hasattr(m, "cos") and hasattr(m, "sin"):
                m.cos, m.sin = m.cos.float(), m.sin.float()
        self.model.eval()
        for m in self.model.modules():  # after the last .to(): the fused weights are plain attributes
            if isinstance(m, (LlamaAttention, LlamaMLP)):
                m.fuse_projections()
        logger.info("loaded %s (%s) in %.1fs", model_path, self.config.architecture, time.perf_counter() - t0)
        self.pools = pools or self._init_pools(context_len, draft_bytes_per_token)
        alloc = self.pools.allocator
        self.kv_pool = KVPool(
            alloc.num_slots,
            self.config.num_hidden_layers,
            self.config.num_key_value_heads,
            self.config.head_dim,
            dtype,
            self.device,
        )
        self.attn_backend = get_backend_class(args.attention_backend)()

    def _context_len(self) -> int:
        model_max = self.config.max_position_embeddings
        if self.args.context_length is None:
            return model_max
        return self.args.context_length

    def _init_pools(self, context_len: int, draft_bytes_per_token: int) -> SharedPools:
        args = self.args
        P = self.page_size
        row_width = get_row_width(context_len, args)
        extra = get_row_width_extra(args)
        per_token = kv_bytes_per_token(self.config, self.dtype) + draft_bytes_per_token
        if args.max_total_tokens is not None:
            total_tokens = args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            frac = args.mem_fraction_static or 0.85
            budget = free - (1 - frac) * total
            total_tokens = int(max(budget, 0) // per_token)
        else:
            total_tokens = int(args.cpu_kv_cache_gb * (1 << 30) // per_token)
        num_pages = total_tokens // P
        if num_pages < 1:
            raise ValueError(
                f"the KV pool holds {total_tokens} tokens, less than one page of {P}: raise --max-total-tokens"
            )
        allocator = PagedAllocator(num_pages, P, self.device)
        rows = self.max_rows
        req_pool = ReqToTokenPool(rows, row_width, self.device)
        logger.info(
            "KV pool: %d pages x %d = %d tokens; req_to_token %d rows x %d (context %d + extra %d%s), row memory "
            "%.2f MiB (headroom %.2f MiB)",
            num_pages,
            P,
            num_pages * P,
            rows,
            row_width,
            context_len,
            extra,
            " speculative" if speculation_enabled(args) else "",
            req_pool.req_to_token.numel() * 8 / 2**20,
            rows * extra * 8 / 2**20,
        )
        return SharedPools(allocator, req_pool, context_len, row_width)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        """The only place attention metadata is built: every forward of this runner goes through here."""
        self.attn_backend.init_forward_metadata(fb)
        hidden, features = self.model(fb)
        if fb.logits_indices is not None and fb.logits_indices.numel() == 0:
            return ForwardOutput(hidden, None, features)
        sel = hidden if fb.logits_indices is None else hidden[fb.logits_indices]
        return ForwardOutput(hidden, self.model.compute_logits(sel), features)

    def make_batch(self, **kw: Any) -> ForwardBatch:
        return ForwardBatch(
            req_to_token=self.pools.req_to_token_pool.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            page_size=self.page_size,
            **kw,
        )

    def extend_batch(
        self,
        rows: list[int],
        ids: list[list[int]],
        prefix_lens: list[int],
        mode: ForwardMode = ForwardMode.EXTEND,
        input_hidden: torch.Tensor | None = None,
        capture_hidden: CaptureHidden = CaptureHidden.NONE,
        logit_starts: list[int] | None = None,
    ) -> ForwardBatch:
        """New tokens `ids[i]` at positions prefix_lens[i].. of row rows[i]; logits for each request's last token,
        or for its positions logit_starts[i] .. last when given (prompt logprobs, layers/logprobs.py)."""
        rtt = self.pools.req_to_token_pool.req_to_token
        flat_ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        for row, toks, p in zip(rows, ids, prefix_lens):
            flat_ids += toks
            positions += range(p, p + len(toks))
            token_rows += [row] * len(toks)
        pos = self._tensor(positions)
        ext = [len(t) for t in ids]
        if logit_starts is None:
            logits_indices = self._tensor(ext).cumsum(0) - 1
        else:
            picked: list[int] = []
            offset = 0
            for p, n, first in zip(prefix_lens, ext, logit_starts):
                picked += range(offset + first - p, offset + n)
                offset += n
            logits_indices = self._tensor(picked)
        return self.make_batch(
            mode=mode,
            input_ids=self._tensor(flat_ids),
            positions=pos,
            out_cache_loc=rtt[self._tensor(token_rows), pos],
            req_rows=self._tensor(rows),
            prefix_lens=list(prefix_lens),
            extend_lens=ext,
            logits_indices=logits_indices,
            input_hidden=input_hidden,
            capture_hidden=capture_hidden,
        )

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)
