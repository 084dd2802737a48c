"""I1's per-step checks in one C++ call (`csrc/step_checks.cpp`), the Python ones as reference.

`attention.begin_step` checks a step's writes, marks them written and verifies
every page table against the ledger before the model touches any K/V. Done as
tensor ops that is about thirty small operations, a third of a millisecond a
step: 1.5% of a one-row decode step of SmolLM2-135M, over the 1% the isolation
check may cost (`bench/engine_step.py --compare ledger`). The kernel makes the
same checks in one pass.

It only ever says "every check passed": on a refusal, or any operand it was
not built for (another dtype, a strided 1-D tensor), `begin_step` runs the
reference path, which raises the explained `IsolationViolation`. A kernel that
wrongly refused would cost speed, never isolation; one that wrongly passed is
what the isolation tests and the differential test against the reference catch
(`tests/model/test_step_checks.py`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfence.kv.pool import KVPool, PageState
from kvfence.model.base import ForwardBatch
from kvfence.model.paged_cpu import library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Step(ctypes.Structure):
    """step_checks.cpp's Step, field for field."""

    _fields_ = [
        *[(n, _i64) for n in ("rows", "width", "tokens")],
        *[(n, _ptr) for n in ("pages", "generations", "owners")],
        *[(n, _i64) for n in ("pages_s0", "pages_s1", "gens_s0", "gens_s1")],
        *[(n, _i64) for n in ("owners_s0", "owners_s1")],
        *[(n, _ptr) for n in ("valid", "readers", "namespaces", "lengths", "query_starts")],
        *[(n, _ptr) for n in ("positions", "slots", "owner", "generation", "state", "written")],
        *[(n, _i64) for n in ("num_pages", "page_size", "used_state")],
        ("check", ctypes.c_int),
    ]


class StepChecks:
    """`passes(pool, batch, check)`: True when the step's writes and reads are entitled and its
    pages are now marked written; False: run the reference (`attention.begin_step`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.kvf_step_checks
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Step)]
        self._fn = fn

    def passes(self, pool: KVPool, batch: ForwardBatch, check: bool = True) -> bool:
        """`check=False` (the lab's no-ledger-check) only marks the writes, as the reference."""
        if not operands_fit(pool, batch):
            return False
        p = batch.pages
        tables = (p.pages, p.generations, p.owners)
        rows, width = p.pages.shape
        step = _Step(
            rows, width, batch.slot_mapping.numel(),
            *(t.data_ptr() for t in tables), *(s for t in tables for s in t.stride()),
            p.valid.data_ptr(), *(t.data_ptr() for t in _flat(pool, batch)),
            pool.num_pages, pool.page_size, int(PageState.USED), int(check),
        )  # fmt: skip
        return bool(self._fn(ctypes.byref(step)) == 0)


def _flat(pool: KVPool, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
    """The 1-D arrays the kernel reads, in `_Step`'s order after `valid`."""
    p = batch.pages
    return (p.readers, p.namespaces, p.lengths, batch.query_starts, batch.positions,
            batch.slot_mapping, pool.owner, pool.generation, pool.state, pool.written)  # fmt: skip


def operands_fit(pool: KVPool, batch: ForwardBatch) -> bool:
    """The dtypes and layouts the kernel reads, and every array as long as it reads it (the
    kernel trusts these extents); anything else goes to the reference."""
    p = batch.pages
    rows, width = p.pages.shape if p.pages.dim() == 2 else (-1, -1)
    flat = _flat(pool, batch)
    ledger = (pool.owner, pool.generation, pool.written, pool.state)
    return (
        all(t.is_contiguous() for t in (*flat, p.valid))
        and all(t.dtype == torch.int64 for t in flat if t is not pool.state)
        and pool.state.dtype == torch.int8
        and p.valid.dtype == torch.bool
        and all(t.dtype == torch.int64 for t in (p.pages, p.generations, p.owners))
        and all(t.shape == (rows, width) for t in (p.pages, p.generations, p.owners, p.valid))
        and all(t.shape == (rows,) for t in (p.readers, p.namespaces, p.lengths))
        and batch.query_starts.shape == (rows + 1,)
        and batch.positions.dim() == 1
        and batch.positions.shape == batch.slot_mapping.shape
        and all(t.shape == (pool.num_pages,) for t in ledger)
    )


@functools.cache
def load() -> StepChecks | None:
    """The kernel's checks, or None when the library was not built (the reference runs)."""
    lib = library()
    return None if lib is None else StepChecks(lib)
