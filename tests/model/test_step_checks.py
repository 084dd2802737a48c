"""The I1 step checks' kernel against the reference tensor ops: it passes only what they pass.

Seeded random steps over a small pool, honest or with one forgery each (a page of
another tenant, a stale generation, a freed page, a short written prefix, a row
attending past its table, a token written past the row's context, a slot or position
moved, a page outside the pool, a malformed row index, ...). For every step the
kernel's verdict is compared with the reference's (`attention.check_step`), and the
written-slot marks each leaves. Each kernel check, removed on its own, fails at least
one case here (checked by hand).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
from kvmodel_helpers import make_pool

from kvfence.kv.pool import IsolationViolation, KVPool, PageState
from kvfence.model.attention import begin_step, check_step
from kvfence.model.base import ForwardBatch
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.config import ModelConfig
from kvfence.model.step_checks import StepChecks, operands_fit
from kvfence.model.step_checks import load as load_step_checks

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=32,
)
PS = 4
FORGERIES = (
    "none", "other-tenants-page", "claims-other-owner", "stale-generation", "freed-page",
    "pending-page", "short-written", "past-table", "slot-moved", "position-moved",
    "page-outside-pool", "padding-outside-pool", "rows-malformed", "padding-marked-valid",
    "namespace-page", "writes-past-length",
)  # fmt: skip


@pytest.fixture(scope="module")
def kernel() -> StepChecks:
    fast = load_step_checks()
    assert fast is not None, "the C++ kernels are built at install (make install)"
    return fast


@dataclass
class Case:
    pool: KVPool
    batch: ForwardBatch
    honest: bool


def _case(seed: int, forgery: str) -> Case:
    """Rows that each read their own pages (written up to `start`) and write `n` new tokens."""
    rng = random.Random(seed)
    pool = make_pool(CONFIG, 40, page_size=PS)
    owners = [pool.register_owner(f"t{i}") for i in range(3)]
    rows, others = [], []
    for owner in owners:
        start, n = rng.randrange(1, 12), rng.randrange(1, 9)  # some context already cached
        pages = pool.allocate(owner, -(-(start + n) // PS) + rng.randrange(0, 2))
        for i, h in enumerate(pages):
            pool.written[h.index] = max(0, min(PS, start - i * PS))
        rows.append(RowSpec(pages, owner, [1] * n, start))
        others.append(pages)
    pool.release(pool.allocate(owners[0], 2))  # freed pages at later generations
    if forgery == "namespace-page":  # a shared-prefix page read through the row's namespace
        ns = pool.register_owner("shared")
        page = pool.allocate(ns, 1)[0]
        pool.written[page.index] = PS
        rows[1] = replace(
            rows[1], pages=[page, *rows[1].pages], namespace=ns, start=rows[1].start + PS
        )
    batch = build_forward_batch(PS, rows)
    return Case(
        pool, _forge(batch, pool, forgery, others, rng), forgery in ("none", "namespace-page")
    )


def _forge(
    batch: ForwardBatch, pool: KVPool, forgery: str, others: list, rng: random.Random
) -> ForwardBatch:
    p, r = batch.pages, rng.randrange(3)
    col = int(p.valid[r].sum()) - 1
    table = {
        k: getattr(p, k).clone() for k in ("pages", "generations", "owners", "valid", "lengths")
    }
    page = int(p.pages[r, col])
    if forgery in ("other-tenants-page", "claims-other-owner"):
        h = others[(r + 1) % 3][0]
        table["pages"][r, col], table["generations"][r, col] = h.index, h.generation
        table["owners"][r, col] = h.owner if forgery == "other-tenants-page" else p.readers[r]
    elif forgery == "stale-generation":
        pool.generation[page] += 1
    elif forgery == "freed-page":
        pool.state[page] = int(PageState.FREE)
    elif forgery == "pending-page":
        pool.state[page] = int(PageState.PENDING_RELEASE)
    elif forgery == "short-written":  # a page the row reads but nothing wrote (the incident)
        pool.written[int(p.pages[r, 0])] = 0  # rows start past position 0 (_case)
    elif forgery == "writes-past-length":  # the last new token lies past the row's context
        table["lengths"][r] -= 1
    elif forgery == "past-table":
        table["lengths"][r] = int(p.valid[r].sum()) * PS + 1
    elif forgery == "slot-moved":
        return replace(batch, slot_mapping=batch.slot_mapping + (rng.randrange(2) * 2 - 1))
    elif forgery == "position-moved":
        return replace(batch, positions=batch.positions + PS)
    elif forgery == "page-outside-pool":
        table["pages"][r, col] = pool.num_pages + 3
    elif forgery == "padding-outside-pool":
        table = _padded(table)
        table["pages"][r, -1] = pool.num_pages
    elif forgery == "rows-malformed":
        starts = batch.query_starts.clone()
        starts[1], starts[2] = starts[2], starts[1] - 1
        return replace(batch, query_starts=starts)
    elif forgery == "padding-marked-valid":
        table = _padded(table)
        table["valid"][r, -1] = True  # reads page 0 under its padding handle (owner FREE, gen 0)
        table["lengths"][r] = table["valid"][r].sum() * PS
    return replace(batch, pages=replace(p, **table))


def _padded(table: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One more padding column (page 0, generation 0, owner 0, not valid)."""
    return {
        k: torch.cat((v, torch.zeros_like(v[:, :1])), dim=1) if v.dim() == 2 else v
        for k, v in table.items()
    }


def _reference(case: Case, check: bool = True) -> tuple[bool, list[int]]:
    saved = case.pool.written.clone()
    try:
        check_step(case.pool, case.batch, check)
        ok = True
    except (IsolationViolation, IndexError, ValueError, RuntimeError):
        ok = False
    marks = case.pool.written.tolist()
    case.pool.written.copy_(saved)
    return ok, marks


@pytest.mark.parametrize("forgery", FORGERIES)
def test_the_kernel_passes_exactly_what_the_reference_passes(
    kernel: StepChecks, forgery: str
) -> None:
    for seed in range(40):
        case = _case(seed, forgery)
        ref_ok, ref_marks = _reference(case)
        ok = kernel.passes(case.pool, case.batch)
        assert ok == ref_ok, f"seed {seed}: kernel {ok}, reference {ref_ok}"
        assert ok == case.honest, f"seed {seed}: a {forgery} step {'passed' if ok else 'refused'}"
        if ok:  # the kernel's marks are the reference's
            assert case.pool.written.tolist() == ref_marks


def test_under_no_ledger_check_it_only_marks_the_writes(kernel: StepChecks) -> None:
    for seed in range(20):
        case = _case(seed, "other-tenants-page")
        ref_ok, ref_marks = _reference(case, check=False)
        assert ref_ok and kernel.passes(case.pool, case.batch, check=False)
        assert case.pool.written.tolist() == ref_marks


def test_begin_step_raises_the_references_explained_violation() -> None:
    case = _case(0, "other-tenants-page")
    with pytest.raises(IsolationViolation, match="owner") as refused:
        begin_step(case.pool, case.batch)
    assert refused.value.page >= 0


def test_operands_of_other_extents_never_reach_the_kernel(kernel: StepChecks) -> None:
    """The kernel trusts the arrays' lengths: a table, mask or row array of another extent
    (which it would read past) goes to the reference instead."""
    case = _case(0, "none")
    p = case.batch.pages
    forged = (
        replace(p, valid=p.valid[:, :-1].contiguous()),
        replace(p, lengths=p.lengths[:-1].clone()),
        replace(p, readers=p.readers[:-1].clone()),
    )
    batches = [replace(case.batch, pages=pages) for pages in forged]
    batches.append(replace(case.batch, query_starts=case.batch.query_starts[:-1].clone()))
    batches.append(replace(case.batch, positions=case.batch.positions[:-1].clone()))
    for batch in batches:
        assert not operands_fit(case.pool, batch)
        assert not kernel.passes(case.pool, batch)
    assert operands_fit(case.pool, case.batch) and kernel.passes(case.pool, case.batch)
