"""Name -> backend class. Routing derives its whitelist from each class's capability flag."""

from __future__ import annotations

import importlib

from treepage.layers.attention.base import AttentionBackend
from treepage.server_args import ArgumentError

_BACKENDS = {
    "torch_native": ("treepage.layers.attention.torch_native_backend", "TorchNativeAttnBackend"),
    "triton": ("treepage.layers.attention.triton_backend", "TritonAttnBackend"),
    "sdpa": ("treepage.layers.attention.sdpa_backend", "SdpaAttnBackend"),
}


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ArgumentError(f"--attention-backend {name!r} is unknown; allowed: {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def paged_tree_backends() -> list[str]:
    """Backends that implement the cascade draft decode and the tree verify over page tables."""
    return [n for n in _BACKENDS if get_backend_class(n).supports_paged_tree_draft]
