"""Models on paged KV: Llama-family decoders and the diagnostic mirror model.

Knows no roles or transports (DESIGN.md, Conventions). Public entry points:
`load_model` (an HF directory -> model + config + tokenizer),
`make_tiny_checkpoint` / `default_checkpoint_dir` (seeded checkpoints), and
`build_forward_batch` (per-row specs -> the `ForwardBatch` a model runs).
"""

from kvfence.model.base import CausalLM, ForwardBatch
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.config import ModelConfig, UnsupportedModelError
from kvfence.model.loader import LoadedModel, ModelFilesError, load_model
from kvfence.model.tiny import default_checkpoint_dir, make_tiny_checkpoint
from kvfence.model.tokenizer import StreamingDetokenizer, Tokenizer

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
