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
the few-token linear kernel (`model.linear_cpu`), into one library in
`$KVFENCE_EXT_DIR` (default: `<venv>/share/kvfence`), named by a hash of the
sources and flags so a stale build is never loaded. Without a C++ compiler the
engine uses the gather path (`CPUAttention` falls back and says so in the log).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / n
    for n in (
        "paged_decode.cpp",
        "paged_prefill.cpp",
        "small_linear.cpp",
        "spin_pool.cpp",
        "rows.cpp",
        "decode_layers.cpp",
        "step_checks.cpp",
    )
)
HEADERS = (CSRC / "spin_pool.h", CSRC / "vec.h")
# OpenMP only for `omp simd`: the kernels' threads are spin_pool's, not libgomp's.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-pthread", "-shared", "-fPIC", "-std=c++17")


def library_path() -> Path:
    """Where the built library for these sources and these flags lives."""
    root = Path(os.environ.get("KVFENCE_EXT_DIR", Path(sys.prefix) / "share" / "kvfence"))
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(FLAGS).encode()
    digest = hashlib.sha256(text).hexdigest()[:12]
    return root / f"kvfence_paged_{digest}.so"


def build() -> Path:
    """Compile the kernel (a second or two); raises RuntimeError naming what is missing."""
    out = library_path()
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found: install g++ to build the paged kernel")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([cxx, *FLAGS, *map(str, SOURCES), "-o", str(tmp)], check=True)
    tmp.replace(out)  # atomic: a concurrent loader sees the old state or the whole library
    return out


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
    """The built library, or None (logged once) when it was not built for these sources."""
    path = library_path()
    if not path.exists():
        log.warning("C++ kernels not built (%s); using the gather path and torch's linear", path)
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
    print(f"paged decode kernel: {build()}")
