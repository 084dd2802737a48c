"""Prefill-sized float32 linears through oneDNN, each weight packed once into its blocked layout.

Above `linear_cpu.SMALL_TOKENS` rows a linear layer is compute-bound. On this
CPU build torch's `F.linear` goes to MKL, which reached 56-62 GFLOP/s per core
on the SmolLM2 layer shapes here (an AMD EPYC with AVX-512), where oneDNN with
the weight reordered once reached 75-90 (`bench/prefill.py` measures both in one
run). oneDNN also fuses what follows the matmul into the same pass: the
residual add (`binary add`), SiLU on the gate (`swish`) and the gate-times-up
product (`binary mul`), so a prefill layer's MLP is three calls and no
elementwise pass over its [T, 2 * ff] activations.

Packed copies are made on first use and kept until `forget` (the model calls
it when it loads weights); each entry holds its source tensor, so the address
it is keyed by cannot be reused while the entry lives.
"""

from __future__ import annotations

import torch

_OPS = torch.ops.mkldnn


def available() -> bool:
    """Whether this torch build has the oneDNN linear ops (x86 CPU builds do)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(_OPS, "_linear_pointwise")


class PackedLinears:
    """`linear`, `glu`: F.linear semantics on float32 2-D inputs, weights packed once."""

    def __init__(self) -> None:
        self._packed: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._packed)

    def forget(self) -> None:
        """Drop every packed copy (the weights they came from changed)."""
        self._packed.clear()

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), int(w.shape[0]), int(w.shape[1]))
        entry = self._packed.get(key)
        if entry is None:
            entry = (w, _OPS._reorder_linear_weight(w.detach(), None))
            self._packed[key] = entry
        return entry[1]

    def linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual + F.linear(x, w, b)`, the add fused into the matmul."""
        return _matmul(x, self.pack(w), b, residual)

    def glu(
        self,
        x: torch.Tensor,
        gate_up_w: torch.Tensor,
        gate_up_b: torch.Tensor | None,
        down_w: torch.Tensor,
        down_b: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual + F.linear(silu(x W_gate^T) * (x W_up^T), W_down)` for fused gate/up rows."""
        ff = int(down_w.shape[1])
        gate_w, up_w, packed_down = self.pack_mlp(gate_up_w, down_w)
        gb, ub = (None, None) if gate_up_b is None else (gate_up_b[:ff], gate_up_b[ff:])
        gate = _OPS._linear_pointwise(x, gate_w, gb, "swish", [], "")
        act = _OPS._linear_pointwise.binary(x, gate, up_w, ub, "mul")
        return _matmul(act, packed_down, down_b, residual)

    def pack_mlp(
        self, gate_up_w: torch.Tensor, down_w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed gate, up and down weights of a fused [2 * ff, hidden] gate/up weight."""
        ff = int(down_w.shape[1])
        if gate_up_w.shape[0] != 2 * ff:
            raise ValueError(
                f"glu: gate/up weight has {gate_up_w.shape[0]} rows, expected 2 * {ff}"
            )
        return self.pack(gate_up_w[:ff]), self.pack(gate_up_w[ff:]), self.pack(down_w)


def _matmul(
    x: torch.Tensor, packed_w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """`residual + x @ W^T + b` on a packed weight, the add fused into the matmul."""
    if residual is None:
        return _OPS._linear_pointwise(x, packed_w, b, "none", [], "")
    return _OPS._linear_pointwise.binary(x, residual, packed_w, b, "add")
