"""Linear layers for few-token steps: the C++ kernel below `SMALL_TOKENS`, torch's above.

A decode step at low concurrency multiplies a handful of token rows by every
weight matrix, so it is bound by reading the weights once. torch's float32
linear (MKL) reads them at about half the memory bandwidth there; the kernel
in `csrc/small_linear.cpp` streams each weight row once against up to four
tokens in registers, with the RMSNorm before it fused into the same call (`bench/engine_step.py --linear` measures both in one run).
Prefill-sized batches, other dtypes and non-contiguous operands take
`F.linear`. Built with the paged decode kernel (`model.paged_cpu`).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kvfence.model.paged_cpu import library


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


SMALL_TOKENS = 16  # at or below: the kernel (it matched or beat MKL up to 16 rows here)


class CPULinear:
    """`linear(x, w, b)` = `F.linear(x, w, b)`; the kernel for float32 steps of few tokens."""

    def __init__(self, kernel: bool = True) -> None:
        lib = library() if kernel else None
        self._fn = None if lib is None else lib.kvf_small_linear
        if self._fn is not None:
            self._fn.restype = None
            self._fn.argtypes = (
                [ctypes.c_void_p] * 4
                + [ctypes.c_int64] * 3
                + [
                    ctypes.c_int,
                    ctypes.c_void_p,
                    ctypes.c_float,
                ]
            )

    @property
    def has_kernel(self) -> bool:
        return self._fn is not None

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self._fits(x, w, b):
            return F.linear(x, w, b)
        return self._run(x, w, b, None, 0.0)

    def normed(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`linear(rms_norm(x, norm, eps), w, b)`, the norm fused into the kernel's call."""
        if not (self._fits(x, w, b) and norm.dtype == torch.float32 and norm.is_contiguous()):
            return F.linear(rms_norm(x, norm, eps), w, b)
        return self._run(x, w, b, norm, eps)

    def _fits(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        return not (
            self._fn is None
            or x.dim() != 2
            or x.shape[0] > SMALL_TOKENS
            or not (x.dtype == w.dtype == torch.float32)
            or not (x.is_contiguous() and w.is_contiguous())
            or (b is not None and not (b.dtype == torch.float32 and b.is_contiguous()))
        )

    def _run(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        norm: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        assert self._fn is not None
        m, k = x.shape
        n = w.shape[0]
        if w.shape[1] != k:
            raise ValueError(f"linear: input has {k} features, weight expects {w.shape[1]}")
        out = torch.empty((m, n), dtype=torch.float32)
        self._fn(
            x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
            m, n, k, torch.get_num_threads(), None if norm is None else norm.data_ptr(), eps,
        )  # fmt: skip
        return out
