"""Paged attention: K/V are written at slots and read back only through page tables.

Every model step starts with `begin_step` (I1): the new tokens' slots must lie
in their own row's page table at their positions, the pages they fill are
marked written (only where that extends a contiguous written prefix, so a hole
left by a transfer that never arrived stays a hole), and the ledger verifies
every page the step will read — once, before any gather. After that, K/V
leave the pool only through those verified tables: `gather` (the mirror, and
the fallback where no kernel fits) or the paged kernels (`model.paged_cpu`),
which read decode and prefill rows' pages in place.

Backends plug in behind `AttentionBackend` (a CPU one here; GPU kernels later)
and are looked up by name with `get_backend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvfence.faults import Fault
from kvfence.kv.pool import BatchPages, IsolationViolation, KVPool
from kvfence.model.base import ForwardBatch
from kvfence.model.batching import rows_of_tokens
from kvfence.model.paged_cpu import PagedDecodeKernel, PagedPrefillKernel, load_prefill
from kvfence.model.paged_cpu import load as load_kernel
from kvfence.model.rows_cpu import RowOps
from kvfence.model.step_checks import load as load_step_checks

# ---- the step prologue (I1) ---------------------------------------------------------------


def token_rows(batch: ForwardBatch) -> torch.Tensor:
    """[T] the row each new token belongs to (derived from `query_starts`, never given)."""
    return rows_of_tokens(batch.query_starts)


def _check_slots(pool: KVPool, batch: ForwardBatch, rows: torch.Tensor) -> None:
    """A row writes only into its own page table, at the slot its position names (I1 for writes)."""
    pages = batch.pages
    ps = pool.page_size
    col = batch.positions // ps
    width = pages.pages.shape[1]
    in_table = (col < width) & (batch.positions < pages.lengths[rows])
    col = col.clamp(max=max(width - 1, 0))
    expected = pages.pages[rows, col] * ps + batch.positions % ps
    ok = in_table & pages.valid[rows, col] & (expected == batch.slot_mapping)
    if bool(ok.all()):
        return
    t = int((~ok).nonzero()[0])
    raise IsolationViolation(
        f"token at position {int(batch.positions[t])} of row {int(rows[t])} writes outside its page table",
        page=int(batch.slot_mapping[t]) // ps,
        expected=f"slot {int(expected[t])}" if bool(in_table[t]) else "a position inside the table",
        found=f"slot {int(batch.slot_mapping[t])}",
    )


def _mark_written(pool: KVPool, batch: ForwardBatch) -> None:
    """Extend each touched page's written prefix, but only across no hole."""
    ps = pool.page_size
    page = batch.slot_mapping // ps
    offset = batch.slot_mapping % ps
    touched, inverse = torch.unique(page, return_inverse=True)
    lo = torch.full((touched.numel(),), ps, dtype=torch.int64).scatter_reduce_(
        0, inverse, offset, reduce="amin"
    )
    hi = torch.zeros(touched.numel(), dtype=torch.int64).scatter_reduce_(
        0, inverse, offset + 1, reduce="amax"
    )
    contiguous = pool.written[touched] >= lo
    pool.mark_written(touched[contiguous], hi[contiguous])


def begin_step(pool: KVPool, batch: ForwardBatch) -> None:
    """Check writes, record them, then verify every page table once before any gather (I1).

    The kernel (`model.step_checks`) makes these checks in one call; where it refuses, or
    is not built, `check_step` (the reference) makes them again and raises the explained
    violation.

    `Fault.NO_LEDGER_CHECK` removes the write check here and `pool.verify` honours it too.
    """
    if batch.slot_mapping.numel() == 0:
        raise ValueError("a forward step needs at least one new token")
    check = Fault.NO_LEDGER_CHECK not in pool.faults
    fast = load_step_checks()
    if fast is not None and fast.passes(pool, batch, check):
        return  # every check `check_step` makes passed, in one kernel call (model.step_checks)
    check_step(pool, batch, check)


def check_step(pool: KVPool, batch: ForwardBatch, check: bool = True) -> None:
    """The reference checks, as tensor ops; also what explains a refusal of the kernel's."""
    if check:
        _check_slots(pool, batch, token_rows(batch))
    _mark_written(pool, batch)
    if check:
        pool.verify(batch.pages)


# ---- the one read path --------------------------------------------------------------------


def gather(
    pool: KVPool,
    layer: int,
    pages: BatchPages,
    rows: torch.Tensor | None = None,
    num_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `rows` (default all), read through their page tables: [R, P*page_size, kv_heads, head_dim].

    Only the first `num_pages` table entries are read (default: all). Padding
    entries read page 0 and must be masked by `pages.lengths`.
    """
    table = pages.pages if rows is None else pages.pages[rows]
    if num_pages is not None:
        table = table[:, :num_pages]
    r, m = table.shape
    ps, kvh, hd = pool.page_size, pool.geometry.num_kv_heads, pool.geometry.head_dim
    flat = table.reshape(-1)
    k = pool.k[layer].index_select(0, flat).view(r, m * ps, kvh, hd)
    v = pool.v[layer].index_select(0, flat).view(r, m * ps, kvh, hd)
    return k, v


# ---- backends ------------------------------------------------------------------------------


@dataclass(slots=True)
class _PrefillRow:
    row: int
    start: int  # first new token in the flat arrays
    end: int
    length: int  # keys attended (context after this step)
    num_pages: int
    causal_from_zero: bool  # the new tokens are the whole context: plain causal mask
    positions: torch.Tensor


@dataclass(slots=True)
class AttentionPlan:
    """Per-step bookkeeping shared by all layers: which rows decode, masks per window."""

    batch: ForwardBatch
    decode_rows: torch.Tensor  # rows with exactly one new token
    decode_tokens: torch.Tensor  # their token index in the flat arrays
    decode_pages: int
    decode_is_all: bool  # every token is a decode token, in row order
    prefill: list[_PrefillRow]
    prefill_meta: torch.Tensor  # [4, N]: table row, first token, end, length per prefill row
    page_size: int
    dtype: torch.dtype
    _masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        key = ("decode", -1, window)
        if key not in self._masks:
            lengths = self.batch.pages.lengths[self.decode_rows]
            qpos = self.batch.positions[self.decode_tokens]
            kpos = torch.arange(self.decode_pages * self.page_size)
            mask = (kpos[None, :] < lengths[:, None]) & (kpos[None, :] <= qpos[:, None])
            if window is not None:
                mask &= kpos[None, :] > qpos[:, None] - window
            # Additive float mask, built once per step: SDPA converts a bool mask on every call.
            additive = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf"))
            self._masks[key] = additive[:, None, None, :]  # [R, 1, 1, L]
        return self._masks[key]

    def decode_bounds(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """[R] first and one-past-last key position each decode row attends (the mask as a range)."""
        key = ("bounds", -1, window)
        if key not in self._masks:
            qpos = self.batch.positions[self.decode_tokens]
            hi = torch.minimum(self.batch.pages.lengths[self.decode_rows], qpos + 1)
            lo = torch.zeros_like(qpos) if window is None else (qpos - window + 1).clamp(min=0)
            self._masks[key] = torch.stack((lo, hi))
        bounds = self._masks[key]
        return bounds[0], bounds[1]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        p = self.prefill[i]
        if p.causal_from_zero and window is None:
            return None
        key = ("prefill", i, window)
        if key not in self._masks:
            kpos = torch.arange(p.length)
            mask = kpos[None, :] <= p.positions[:, None]
            if window is not None:
                mask &= kpos[None, :] > p.positions[:, None] - window
            self._masks[key] = mask
        return self._masks[key]


class AttentionBackend(ABC):
    """Writes new K/V at slots and attends through page tables. Stateless between steps."""

    @abstractmethod
    def write(
        self, pool: KVPool, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v ([T, kv_heads, head_dim]) at `slot_mapping` in `layer`."""

    @abstractmethod
    def plan(
        self, pool: KVPool, batch: ForwardBatch, dtype: torch.dtype = torch.float32
    ) -> AttentionPlan:
        """Per-step metadata (masks in the compute `dtype`), computed once for all layers."""

    @abstractmethod
    def attend(
        self,
        pool: KVPool,
        layer: int,
        q: torch.Tensor,
        plan: AttentionPlan,
        *,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, heads, head_dim] -> [T, heads * head_dim], causal, K/V only via `gather`."""


class CPUAttention(AttentionBackend):
    """Decode rows: the paged kernel in place; prefill rows: the paged prefill kernel in place.
    Either gathers the pages and runs SDPA instead where its kernel is not built, the dtype is
    not float32, or (prefill) the head dim has no kernel.

    `kernel=False` forces the gather path (the reference the kernels are tested against);
    `vector=False` the decode kernel's scalar path (what it runs for shapes without a vector
    one).
    """

    def __init__(self, kernel: bool = True, vector: bool = True) -> None:
        self.kernel: PagedDecodeKernel | None = load_kernel() if kernel else None
        self.prefill_kernel: PagedPrefillKernel | None = load_prefill() if kernel else None
        self.rows = RowOps(kernel)  # the K/V write
        self.vector = vector

    def write(
        self, pool: KVPool, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        kvh, hd = pool.geometry.num_kv_heads, pool.geometry.head_dim
        if k.dtype != pool.k.dtype:
            k, v = k.to(pool.k.dtype), v.to(pool.v.dtype)
        self.rows.write_kv(
            pool.k[layer].view(-1, kvh, hd), pool.v[layer].view(-1, kvh, hd), slot_mapping, k, v
        )

    def plan(
        self, pool: KVPool, batch: ForwardBatch, dtype: torch.dtype = torch.float32
    ) -> AttentionPlan:
        ps = pool.page_size
        width = int(batch.pages.pages.shape[1])
        starts = batch.query_starts.tolist()
        lengths = batch.pages.lengths.tolist()
        decode_rows: list[int] = []
        prefill: list[_PrefillRow] = []
        for row in range(batch.num_rows):
            s, e = starts[row], starts[row + 1]
            if e - s == 1:
                decode_rows.append(row)
                continue
            length = min(int(lengths[row]), width * ps)  # shorter only for forged tables
            positions = batch.positions[s:e]
            from_zero = length == e - s and int(positions[0]) == 0
            prefill.append(_PrefillRow(row, s, e, length, -(-length // ps), from_zero, positions))
        rows_t = torch.tensor(decode_rows, dtype=torch.int64)
        max_len = max((int(lengths[r]) for r in decode_rows), default=0)
        return AttentionPlan(
            batch=batch,
            decode_rows=rows_t,
            decode_tokens=batch.query_starts[rows_t],
            decode_pages=min(-(-max_len // ps), width),
            decode_is_all=len(decode_rows) == batch.num_rows,
            prefill=prefill,
            prefill_meta=torch.tensor(
                [
                    [p.row for p in prefill],
                    [p.start for p in prefill],
                    [p.end for p in prefill],
                    [p.length for p in prefill],
                ],
                dtype=torch.int64,
            ),
            page_size=ps,
            dtype=dtype,
        )

    def attend(
        self,
        pool: KVPool,
        layer: int,
        q: torch.Tensor,
        plan: AttentionPlan,
        *,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        t, heads, hd = q.shape
        if plan.decode_is_all:
            return self._decode(pool, layer, q, plan, scale, window).reshape(t, heads * hd)
        out = q.new_empty((t, heads * hd))
        if plan.decode_rows.numel():
            dq = q[plan.decode_tokens]
            out[plan.decode_tokens] = self._decode(pool, layer, dq, plan, scale, window).reshape(
                -1, heads * hd
            )
        pages = plan.batch.pages
        if self._prefill_in_place(pool, q):
            assert self.prefill_kernel is not None
            self.prefill_kernel.attend(
                q, pool.k[layer], pool.v[layer], pages.pages, plan.prefill_meta,
                plan.batch.positions, out.view(t, heads, hd), scale, window,
            )  # fmt: skip
            return out
        for i, p in enumerate(plan.prefill):
            row = torch.tensor([p.row])
            k, v = gather(pool, layer, pages, row, p.num_pages)
            # [1, L, kvh, hd] -> [1, heads, L, hd]: repeat each KV head for its query group.
            k = _as(k[:, : p.length], q.dtype).permute(0, 2, 1, 3)  # [1, kvh, L, hd]
            v = _as(v[:, : p.length], q.dtype).permute(0, 2, 1, 3)
            qr = q[p.start : p.end].permute(1, 0, 2).unsqueeze(0)  # [1, heads, n, hd]
            mask = plan.prefill_mask(i, window)
            o = F.scaled_dot_product_attention(
                qr, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            out[p.start : p.end] = o[0].permute(1, 0, 2).reshape(p.end - p.start, heads * hd)
        return out

    def _prefill_in_place(self, pool: KVPool, q: torch.Tensor) -> bool:
        return (
            self.prefill_kernel is not None
            and q.dtype == pool.k.dtype == torch.float32
            and pool.k.is_contiguous()
            and q.shape[-1] in PagedPrefillKernel.HEAD_DIMS
        )

    def _decode(
        self,
        pool: KVPool,
        layer: int,
        q: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """One SDPA call for all single-token rows: the query group rides the query-length axis."""
        r, heads, hd = q.shape
        kvh = pool.geometry.num_kv_heads
        rows = None if plan.decode_is_all else plan.decode_rows
        if (
            self.kernel is not None
            and q.dtype == pool.k.dtype == torch.float32
            and pool.k.is_contiguous()
        ):
            table = plan.batch.pages.pages if rows is None else plan.batch.pages.pages[rows]
            lo, hi = plan.decode_bounds(window)
            return self.kernel.attend(
                q, pool.k[layer], pool.v[layer], table, lo, hi, scale, vector=self.vector
            )
        k, v = gather(pool, layer, plan.batch.pages, rows, plan.decode_pages)
        k = _as(k, q.dtype).permute(0, 2, 1, 3)  # [R, kvh, L, hd]
        v = _as(v, q.dtype).permute(0, 2, 1, 3)
        qg = q.view(r, kvh, heads // kvh, hd)  # head h = kv_head * group + g, as HF's repeat_kv
        o = F.scaled_dot_product_attention(
            qg, k, v, attn_mask=plan.decode_mask(window), scale=scale
        )
        return o.reshape(r, heads, hd)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"cpu": CPUAttention}


def get_backend(name: str = "cpu") -> AttentionBackend:
    """A paged-attention backend by name (`available_backends()` lists them)."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_backends())}"
        ) from None


def available_backends() -> list[str]:
    return sorted(_BACKENDS)
