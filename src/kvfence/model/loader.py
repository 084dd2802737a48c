"""Load a Hugging Face model directory into a kvfence model.

Reads `config.json`, `model.safetensors` (or the shards named by
`model.safetensors.index.json`), `tokenizer.json` and the chat template from
`tokenizer_config.json`. A missing file or an unsupported architecture fails
with a message naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from kvfence.kv.geometry import parse_dtype
from kvfence.model.base import CausalLM
from kvfence.model.config import MODEL_KINDS, ModelConfig
from kvfence.model.llama import LlamaModel
from kvfence.model.mirror import MirrorModel
from kvfence.model.tokenizer import Tokenizer

ModelKind = Literal["llama", "mirror", "mirror-body"]


class ModelFilesError(FileNotFoundError):
    """A model directory lacks a file kvfence needs; the message names it."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    kind: str
    dtype: str

    @property
    def name(self) -> str:
        """The served model name: the directory's name."""
        return self.path.name


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ModelFilesError(f"model directory {path.parent} is missing {path.name} ({what})")
    return path


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or the shards its index names."""
    directory = Path(directory)
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        raise ModelFilesError(
            f"model directory {directory} is missing model.safetensors "
            "(or model.safetensors.index.json for a sharded checkpoint)"
        )
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFilesError(f"{index} has no weight_map")
    shards = sorted({str(v) for v in weight_map.values()})
    return [
        _require(directory / s, "a shard named by model.safetensors.index.json") for s in shards
    ]


def load_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        tensors.update(load_file(str(f)))
    return tensors


def load_model(
    directory: str | Path, *, kind: str = "llama", dtype: str = "float32"
) -> LoadedModel:
    """The model, config and tokenizer of an HF directory. `kind="mirror"` loads no weights."""
    path = Path(directory)
    if not path.is_dir():
        raise ModelFilesError(f"model directory {path} does not exist")
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(MODEL_KINDS)}")
    config = ModelConfig.from_file(_require(path / "config.json", "the model configuration"))
    _require(path / "tokenizer.json", "the tokenizer")
    tokenizer = Tokenizer.from_dir(path, extra_eos_ids=config.eos_token_ids)
    torch_dtype = parse_dtype(dtype)
    model: CausalLM
    if kind == "mirror":
        model = MirrorModel.from_config(config)
    elif kind == "mirror-body":
        body = LlamaModel.from_hf_weights(config, load_weights(path), dtype=torch_dtype)
        model = MirrorModel(config, body=body)
    else:
        model = LlamaModel.from_hf_weights(config, load_weights(path), dtype=torch_dtype)
    model.eval()
    return LoadedModel(
        model=model, config=config, tokenizer=tokenizer, path=path, kind=kind, dtype=dtype
    )
