"""KV geometry: the shape of one token's cache, shared by sizing and the pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unsupported KV dtype {name!r}; choose one of {sorted(_DTYPES)}"
        ) from None


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
        parse_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return torch.tensor([], dtype=self.torch_dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.page_size)
