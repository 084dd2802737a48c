"""RMSNorm, RoPE and the K/V write as one pass over the rows each (`csrc/rows.cpp`, on the
calling thread), torch's ops where not fit.

A prefill layer's norms and rotary embedding were a dozen elementwise torch
ops per layer, each its own pass and its own OpenMP region; these are one
each. Float32 and contiguous rows only (RoPE: each row's heads contiguous, any
row stride); anything else, or a library that was not built, takes torch's
path with the same math (`bench/prefill.py --variants` measures both).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kvfence.model.paged_cpu import library


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim/2] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RowOps:
    """`rms_norm(x, w, eps)` and `rope(x, cos, sin)`: the kernel when built and fit (`kernel`)."""

    def __init__(self, kernel: bool = True) -> None:
        lib = library() if kernel else None
        self._norm = None if lib is None else lib.kvf_rms_norm
        self._rope = None if lib is None else lib.kvf_rope
        self._write = None if lib is None else lib.kvf_write_kv
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        if self._norm is not None and self._rope is not None and self._write is not None:
            self._norm.restype = self._rope.restype = None
            self._norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
            self._rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
            self._write.restype = ctypes.c_int
            self._write.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr]

    @property
    def has_kernel(self) -> bool:
        return self._norm is not None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._norm is None or not (
            x.dim() == 2 and f32_contiguous(x) and f32_contiguous(weight)
        ):
            return torch_rms_norm(x, weight, eps)
        if weight.shape != (x.shape[1],):
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for {x.shape[1]} features")
        out = torch.empty_like(x)
        t, h = x.shape
        self._norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), t, h, eps)
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`torch_rope(x, cos, sin)`; the kernel rotates x in place (a view into its own step's
        projection output) and returns it."""
        fits = (
            self._rope is not None
            and x.dim() == 3
            and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
            and cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2] // 2)
        )
        if not fits:
            return torch_rope(x, cos, sin)
        assert self._rope is not None
        t, heads, d = x.shape
        self._rope(x.data_ptr(), t, x.stride(0), heads, d, cos.data_ptr(), sin.data_ptr())
        return x

    def write_kv(
        self,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """`k_slots.index_copy_(0, slot_mapping, k)`, the same for v: token t's K/V into slot
        `slot_mapping[t]` of one layer ([slots, kv_heads, head_dim]). The kernel reads k and v
        in place (each token's heads contiguous, the same token stride: views into the fused
        projection) and checks every slot before it writes any; torch's op otherwise."""
        t = k.shape[0]
        fits = (
            self._write is not None
            and k_slots.dtype == v_slots.dtype == k.dtype == v.dtype == torch.float32
            and k_slots.is_contiguous()
            and v_slots.is_contiguous()
            and k.dim() == v.dim() == 3
            and k.shape == v.shape == (t, *k_slots.shape[1:])
            and v_slots.shape == k_slots.shape
            and k.stride() == v.stride()
            and k.stride(2) == 1
            and k.stride(1) == k.shape[2]
            and slot_mapping.dtype == torch.int64
            and slot_mapping.shape == (t,)
        )
        if not fits:
            k_slots.index_copy_(0, slot_mapping, k)
            v_slots.index_copy_(0, slot_mapping, v)
            return
        assert self._write is not None
        slots = slot_mapping.contiguous()
        width = k.shape[1] * k.shape[2]
        bad = self._write(
            k.data_ptr(), v.data_ptr(), t, k.stride(0), width, slots.data_ptr(),
            k_slots.shape[0], k_slots.data_ptr(), v_slots.data_ptr(),
        )  # fmt: skip
        if bad:
            raise IndexError(f"write_kv: a slot outside the layer's {k_slots.shape[0]} slots")


def f32_contiguous(t: torch.Tensor) -> bool:
    """What the C++ kernels read: float32, contiguous."""
    return t.dtype == torch.float32 and t.is_contiguous()
