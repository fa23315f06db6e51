"""Draft heads trained for the embedded default model (SmolLM2-135M-Instruct), shipped inside the package.

They live in treepage/data/heads/<name>/ in the released layouts (config.json + model.safetensors, no tokenizer:
the engine uses the target's) and are rebuilt by `make train-heads` (docs/training.md).
"""

from __future__ import annotations

import importlib.resources
import os
from typing import cast

SHIPPED_HEADS = {"EAGLE3": "smollm2-eagle3", "EAGLE": "smollm2-eagle"}


def shipped_head_path(algorithm: str) -> str:
    """Directory of the bundled head for `algorithm` ("EAGLE3" or "EAGLE"), usable as --speculative-draft-model-path."""
    name = SHIPPED_HEADS.get(algorithm.upper())
    if name is None:
        raise ValueError(
            f"no shipped draft head for {algorithm!r}; shipped: {', '.join(sorted(SHIPPED_HEADS))}"
        )
    # files() of a regular package (not a zip or namespace package) is a pathlib.Path.
    resource = importlib.resources.files("treepage.data") / "heads" / name
    path = os.fspath(cast("os.PathLike[str]", resource))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"the shipped {algorithm} head is missing at {path}; rebuild it with `make train-heads`"
        )
    return path
