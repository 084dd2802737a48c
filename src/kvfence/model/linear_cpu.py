"""Linear layers for few-token steps: the C++ kernel below `SMALL_TOKENS`, torch's above.

A decode step at low concurrency multiplies a handful of token rows by every
weight matrix, so it is bound by reading the weights once. torch's float32
linear (MKL) reads them at about half the memory bandwidth there; the kernel
in `csrc/small_linear.cpp` reads each weight row once per step against the
step's tokens held in vector registers, the next block of rows prefetched,
with the RMSNorm or SwiGLU before it fused into the same call
(`bench/decode_linear.py` measures it against its scalar tile and MKL, one run).
Prefill-sized float32 batches go to oneDNN with packed weights
(`model.linear_onednn`); other dtypes and non-contiguous operands take
`F.linear`. Built with the paged decode kernel (`model.paged_cpu`).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kvfence.model import linear_onednn
from kvfence.model.linear_onednn import PackedLinears
from kvfence.model.paged_cpu import library
from kvfence.model.rows_cpu import RowOps
from kvfence.model.rows_cpu import f32_contiguous as _f32

SMALL_TOKENS = 16  # at or below: the kernel (it matched or beat MKL up to 16 rows here)


class CPULinear:
    """`linear(x, w, b)` = `F.linear(x, w, b)`; the kernel for float32 steps of few tokens,
    oneDNN with packed weights for float32 steps of more (`onednn=False`: torch's linear).

    `normed` and `glu` fold the RMSNorm before a projection and the SwiGLU before
    the down projection into the same call; `residual` adds the skip connection;
    `mlp` is a layer's whole MLP half.
    """

    def __init__(
        self,
        kernel: bool = True,
        onednn: bool = True,
        rows: RowOps | None = None,
        vector: bool = True,
    ) -> None:
        self.vector = vector  # False: the kernel's scalar tile for every shape (bench, tests)
        self.packed = PackedLinears() if onednn and linear_onednn.available() else None
        self.rows = rows or RowOps(kernel)
        lib = library() if kernel else None
        self._fn = None if lib is None else lib.kvf_small_linear
        if self._fn is not None:
            self._fn.restype = None
            ptr, i64 = ctypes.c_void_p, ctypes.c_int64
            self._fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr]
            self._fn.argtypes += [ctypes.c_float, ctypes.c_int, ptr, ctypes.c_int]

    @property
    def has_kernel(self) -> bool:
        return self._fn is not None

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual + F.linear(x, w, b)` (no residual: just the linear)."""
        if self.packed is not None and _large(x, w, b, residual):
            return self.packed.linear(x, w, b, residual)
        if not self._fits(x, w, b, residual):
            return _plus(residual, F.linear(x, w, b))
        return self._run(x, w, b, residual=residual)

    def normed(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`linear(rms_norm(x, norm, eps), w, b)`, the norm fused into the kernel's call."""
        if not (self._fits(x, w, b, None) and _f32(norm)):
            return self(self.rows.rms_norm(x, norm, eps), w, b)
        return self._run(x, w, b, norm=norm, eps=eps)

    def glu(
        self,
        gate_up: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual + linear(silu(gate) * up, w, b)` for a fused [T, 2 * ff] gate/up output."""
        if not (self._fits(gate_up, w, b, residual) and gate_up.shape[1] == 2 * w.shape[1]):
            gate, up = gate_up.chunk(2, dim=-1)
            return _plus(residual, F.linear(F.silu(gate) * up, w, b))
        return self._run(gate_up, w, b, glu=True, residual=residual)

    def mlp(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        gate_up_w: torch.Tensor,
        gate_up_b: torch.Tensor | None,
        down_w: torch.Tensor,
        down_b: torch.Tensor | None,
    ) -> torch.Tensor:
        """`x + linear(silu(gate) * up, down_w, down_b)`, gate/up = `normed(x, ..., gate_up_w)`."""
        if (
            self.packed is not None
            and _large(x, gate_up_w, gate_up_b, None)
            and _f32(down_w)
            and down_w.shape[0] == x.shape[1]
            and (down_b is None or _f32(down_b))
        ):
            h = self.rows.rms_norm(x, norm, eps)
            return self.packed.glu(h, gate_up_w, gate_up_b, down_w, down_b, residual=x)
        gate_up = self.normed(x, norm, eps, gate_up_w, gate_up_b)
        return self.glu(gate_up, down_w, down_b, residual=x)

    def forget_packed(self) -> None:
        """The weights changed (a load): drop oneDNN's packed copies of them."""
        if self.packed is not None:
            self.packed.forget()

    def _fits(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> bool:
        return (
            self._fn is not None and _f32_operands(x, w, b, residual) and x.shape[0] <= SMALL_TOKENS
        )

    def _run(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        glu: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self._fn is not None
        m, k = x.shape[0], x.shape[1] // 2 if glu else x.shape[1]
        n = w.shape[0]
        if w.shape[1] != k:
            raise ValueError(f"linear: input has {k} features, weight expects {w.shape[1]}")
        out = torch.empty((m, n), dtype=torch.float32)
        self._fn(
            x.data_ptr(), w.data_ptr(), _ptr(b), out.data_ptr(), m, n, k,
            torch.get_num_threads(), _ptr(norm), eps, int(glu), _ptr(residual),
            int(self.vector),
        )  # fmt: skip
        return out


def _large(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None
) -> bool:
    """A float32 step above `SMALL_TOKENS` rows, every operand contiguous: oneDNN's."""
    return (
        _f32_operands(x, w, b, residual) and x.shape[0] > SMALL_TOKENS and x.shape[1] == w.shape[1]
    )


def _f32_operands(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None
) -> bool:
    """x [T, K], w, b and a [T, N] residual: float32 and contiguous, the kernels' operands."""
    return (
        x.dim() == 2
        and _f32(x)
        and _f32(w)
        and (b is None or _f32(b))
        and (residual is None or (_f32(residual) and residual.shape == (x.shape[0], w.shape[0])))
    )


def _plus(residual: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    return y if residual is None else residual + y


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
