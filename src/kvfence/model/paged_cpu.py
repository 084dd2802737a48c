"""The CPU paged attention kernels: a small C++ library built at install, called by ctypes.

Decode rows attend through their page tables in place: the kernel reads each
row's K/V straight from the pool pages its table names, over exactly the
positions it attends, instead of gathering a padded [rows, max_len] copy per
layer and step (that copy moved about as many bytes as the weights at
concurrency 16). Prefill rows (a chunk of a prompt each) do the same through
a causal flash-attention kernel (`paged_prefill.cpp`), which also spends no
work on the masked half: torch's SDPA over the gathered pages was 21% of a
512-token prefill (bench/prefill.py). Both run after `attention.begin_step`
has verified every page table against the ledger (I1), and read nothing the
table does not name.

`make install` builds it (`python -m kvfence.model.paged_cpu build`), with
the few-token linear kernel (`model.linear_cpu`), into one library; an install
without `make` builds it on first use (`model.kernel_build` says where and how).
Without a C++ compiler the engine uses the gather path (`CPUAttention` falls
back and says so in the log, naming what to install).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from kvfence.model.kernel_build import KernelBuildError, build
from kvfence.model.kernel_build import library_path as library_path  # the tests' check

log = logging.getLogger(__name__)


class PagedDecodeKernel:
    """`attend(q, k, v, table, lo, hi, scale)`: out[r] = softmax(q[r] K^T * scale) V over [lo, hi)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.kvf_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
        fn.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        self._fn = fn

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        table: torch.Tensor,
        lo: torch.Tensor,
        hi: torch.Tensor,
        scale: float,
        vector: bool = True,
    ) -> torch.Tensor:
        """q [R, H, D] f32; k, v [P, ps, KVH, D] f32 (one layer); table [R, W]; lo, hi [R] int64.

        `vector=False` forces the scalar path the vector one is tested against.
        """
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("paged kernel: the pool's K/V must be contiguous")
        if not (table.dtype == lo.dtype == hi.dtype == torch.int64):
            raise ValueError("paged kernel: table, lo and hi must be int64")
        q, table, lo, hi = q.contiguous(), table.contiguous(), lo.contiguous(), hi.contiguous()
        r, h, d = q.shape
        p, ps, kvh, _ = k.shape
        out = torch.empty_like(q)
        bad = self._fn(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lo.data_ptr(),
            hi.data_ptr(), out.data_ptr(), r, h, kvh, d, ps, int(table.shape[1]), p,
            scale, torch.get_num_threads(), int(vector),
        )  # fmt: skip
        if bad:
            raise ValueError("paged kernel: a page table names a page outside the pool")
        return out


class PagedPrefillKernel:
    """`attend(...)`: causal attention of prefill rows' tokens over their own pages, in place."""

    HEAD_DIMS = (16, 32, 64, 128)  # the dims it has a kernel for; others gather

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.kvf_paged_prefill
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 9
        fn.argtypes += [ctypes.c_float, ctypes.c_int]
        self._fn = fn

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        table: torch.Tensor,
        meta: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> None:
        """Write `out` [T, H, D] at the prefill rows' tokens.

        q [T, H, D] f32 (each token's heads contiguous, any token stride: a view into the
        step's fused projection is read in place); k, v [P, ps, KVH, D] f32 (one layer);
        table [B, W] int64; meta [4, N] int64: each prefill row's table row, first token, end
        token and length (the keys it may attend, [0, length)); positions [T] int64. A token
        at position p attends keys [p - window + 1, p] within [0, length).
        """
        if not (k.is_contiguous() and v.is_contiguous() and out.is_contiguous()):
            raise ValueError("paged kernel: the pool's K/V and the output must be contiguous")
        if not (table.dtype == meta.dtype == positions.dtype == torch.int64):
            raise ValueError("paged kernel: table, meta and positions must be int64")
        if not (q.stride(2) == 1 and q.stride(1) == q.shape[2]):
            q = q.contiguous()
        table, meta, positions = table.contiguous(), meta.contiguous(), positions.contiguous()
        _, h, d = q.shape
        p, ps, kvh, _ = k.shape
        n = int(meta.shape[1])
        stride = meta.stride(0) * meta.element_size()
        base = meta.data_ptr()
        rc = self._fn(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), base, base + stride,
            base + 2 * stride, base + 3 * stride, positions.data_ptr(), out.data_ptr(),
            n, h, kvh, d, ps, int(table.shape[1]), p, window or 0, q.stride(0), scale,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc == 1:
            raise ValueError("paged kernel: a page table names a page outside the pool")
        if rc:
            raise ValueError(f"paged prefill kernel: no kernel for head dim {d}")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library for these sources, built on first use; None (logged once) if it cannot be."""
    try:
        path = build()  # a no-op where `make install` or an earlier start built it
    except KernelBuildError as e:
        log.warning("C++ kernels not built (%s); using the gather path and torch's linear", e)
        return None
    return ctypes.CDLL(str(path))


def load() -> PagedDecodeKernel | None:
    """The paged decode kernel, or None when the library was not built."""
    lib = library()
    return None if lib is None else PagedDecodeKernel(lib)


def load_prefill() -> PagedPrefillKernel | None:
    """The paged prefill kernel, or None when the library was not built."""
    lib = library()
    return None if lib is None else PagedPrefillKernel(lib)


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m kvfence.model.paged_cpu build")
    try:
        print(f"paged decode kernel: {build()}")
    except KernelBuildError as e:
        sys.exit(f"paged decode kernel not built: {e}")
