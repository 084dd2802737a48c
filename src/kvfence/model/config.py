"""Model configuration parsed from a Hugging Face `config.json`.

Covers the Llama-family decoders kvfence runs: `LlamaForCausalLM`,
`Qwen2ForCausalLM` and `MistralForCausalLM`. Anything else is refused with a
message naming the architecture and the supported ones — never guessed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfence.kv.geometry import KVGeometry

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

# what `load_model(kind=...)` builds; mirror-body: the echo head over the real Llama body
MODEL_KINDS: tuple[str, ...] = ("llama", "mirror", "mirror-body")


class UnsupportedModelError(ValueError):
    """A checkpoint kvfence cannot run faithfully (architecture, RoPE type, activation...)."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """HF `rope_scaling` / `rope_parameters`: `default`, `linear` (factor) or `llama3`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the model code needs, with HF defaults applied and derived values checked."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Sliding-window attention: the window (keys with q_pos - k_pos < window are
    # attended), and per layer whether it applies. None = full attention.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError("sliding_layers must have one entry per layer")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def window_for_layer(self, layer: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.sliding_layers and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    def kv_geometry(self, page_size: int = 16, dtype: str = "float32") -> KVGeometry:
        return KVGeometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=page_size,
            dtype=dtype,
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return _parse(json.load(f))


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        model_type = raw.get("model_type")
        by_type = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
        }
        if model_type in by_type:
            return by_type[str(model_type)]
        raise UnsupportedModelError(
            f"config.json names no architecture (model_type {model_type!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`.
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = float(raw.get("rope_theta", 10000.0))
    source: Mapping[str, Any] | None = None
    if isinstance(params, Mapping):
        theta = float(params.get("rope_theta", theta))
        source = params
    if isinstance(scaling, Mapping):
        source = scaling
    if source is None:
        return theta, RopeScaling()
    rope_type = str(source.get("rope_type", source.get("type", "default")))
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(source.get("factor", 1.0)),
        low_freq_factor=float(source.get("low_freq_factor", 1.0)),
        high_freq_factor=float(source.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            source.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _sliding(
    raw: Mapping[str, Any], arch: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...]]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        flags = tuple(t == "sliding_attention" for t in layer_types)
        return (int(window) if window and any(flags) else None), flags if any(flags) else ()
    if arch == "Qwen2ForCausalLM":
        # Qwen2 applies its window only when `use_sliding_window`, from `max_window_layers` up.
        if not raw.get("use_sliding_window", False) or not window:
            return None, ()
        first = int(raw.get("max_window_layers", num_layers))
        return int(window), tuple(i >= first for i in range(num_layers))
    return (int(window) if window else None), ()


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _parse(raw: Mapping[str, Any]) -> ModelConfig:
    arch = _architecture(raw)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"unsupported activation {act!r}; supported: silu")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        vocab = int(raw["vocab_size"])
        intermediate = int(raw["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None
    head_dim = raw.get("head_dim") or hidden // heads
    theta, scaling = _rope(raw)
    window, sliding_layers = _sliding(raw, arch, layers)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=intermediate,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o bias; Llama's `attention_bias` covers all four.
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=window,
        sliding_layers=sliding_layers,
        bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
        eos_token_ids=_ids(raw.get("eos_token_id")),
    )
