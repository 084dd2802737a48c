"""KV geometry: the shape of one token's cache, shared by sizing and the pool.

Importing this module does not import torch (sizing and the capacity gate run
in the CLI before any model is loaded); only `torch_dtype` needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def _check_dtype(name: str) -> str:
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {name!r}; choose one of {sorted(_DTYPE_BYTES)}")
    return name


def parse_dtype(name: str) -> torch.dtype:
    import torch  # deferred: see the module docstring

    dtype: torch.dtype = getattr(torch, _check_dtype(name))
    return dtype


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Per-token KV shape. bytes/token = 2 (K and V) x layers x kv_heads x head_dim x dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive integer, got {value!r}")
        _check_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.page_size)
