"""Models on paged KV: Llama-family decoders and the diagnostic mirror model.

Knows no roles or transports (docs/ARCHITECTURE.md, "The layers"). Public entry points:
`load_model` (an HF directory -> model + config + tokenizer),
`make_tiny_checkpoint` / `default_checkpoint_dir` (seeded checkpoints), and
`build_forward_batch` (per-row specs -> the `ForwardBatch` a model runs).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): `kvfence.model.config` and the tokenizer need no torch,
# and the router and the CLI read them without paying for it.
_HOME = {
    "CausalLM": "base",
    "ForwardBatch": "base",
    "RowSpec": "batching",
    "build_forward_batch": "batching",
    "ModelConfig": "config",
    "UnsupportedModelError": "config",
    "LoadedModel": "loader",
    "ModelFilesError": "loader",
    "load_model": "loader",
    "default_checkpoint_dir": "tiny",
    "make_tiny_checkpoint": "tiny",
    "StreamingDetokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'kvfence.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvfence.model.{_HOME[name]}"), name)


__all__ = [
    "CausalLM",
    "ForwardBatch",
    "LoadedModel",
    "ModelConfig",
    "ModelFilesError",
    "RowSpec",
    "StreamingDetokenizer",
    "Tokenizer",
    "UnsupportedModelError",
    "build_forward_batch",
    "default_checkpoint_dir",
    "load_model",
    "make_tiny_checkpoint",
]
