"""I3 reconciliation and the payload checksum, pure (no transport)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfence.engine.messages import PageRef, TransferManifest
from kvfence.engine.reconcile import (
    Reservation,
    TransferMismatch,
    payload_checksum,
    reconcile,
)
from kvfence.faults import Fault, FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool

GEOM = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4)
TOKENS = 30  # 8 pages


def setup(faults: FaultSet | None = None) -> tuple[KVPool, Reservation, TransferManifest]:
    pool = KVPool(GEOM, 20, faults=faults or FaultSet())
    gen = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    handles = pool.allocate(pool.register_owner("req"), GEOM.pages_for(TOKENS))
    res = Reservation("room-1", "acme", TOKENS, tuple(handles))
    manifest = TransferManifest(
        room="room-1",
        tenant="acme",
        num_tokens=TOKENS,
        num_pages=8,
        dest_pages=res.refs,
        checksum=payload_checksum(pool, handles, TOKENS),
        first_token=1,
    )
    return pool, res, manifest


def test_a_matching_transfer_passes_and_only_then_is_marked_written() -> None:
    pool, res, m = setup()
    idx = [h.index for h in res.handles]
    assert pool.written[idx].sum() == 0
    reconcile(m, res, pool, payload_checksum(pool, res.handles, TOKENS))
    assert pool.written[idx].tolist() == [4] * 7 + [2]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"room": "room-2"}, "room"),
        ({"tenant": "mallory"}, "tenant"),
        ({"num_tokens": 29}, "num_tokens"),
        ({"num_pages": 7}, "num_pages"),
        ({"checksum": "xxh3-64:0"}, "checksum"),
    ],
)
def test_each_manifest_field_is_checked(change: dict[str, object], field: str) -> None:
    pool, res, m = setup()
    with pytest.raises(TransferMismatch) as err:
        reconcile(dataclasses.replace(m, **change), res, pool, m.checksum)  # type: ignore[arg-type]
    assert err.value.field == field
    assert str(err.value.expected) in str(err.value) and str(err.value.found) in str(err.value)
    assert pool.written.sum() == 0  # nothing marked on a refusal


def test_the_incident_one_page_for_an_eight_page_reservation_is_refused() -> None:
    pool, res, m = setup()
    one = dataclasses.replace(
        m, num_tokens=1, num_pages=1, checksum=payload_checksum(pool, res.handles[:1], 1)
    )
    with pytest.raises(TransferMismatch, match="num_tokens") as err:
        reconcile(one, res, pool, one.checksum)
    assert (err.value.expected, err.value.found) == (TOKENS, 1)


def test_with_decode_trusting_the_bootstrap_the_one_page_transfer_is_accepted() -> None:
    pool, res, m = setup(FaultSet.of(Fault.DECODE_TRUSTS_BOOTSTRAP))
    one = dataclasses.replace(m, num_tokens=1, num_pages=1, checksum="whatever")
    reconcile(one, res, pool, "xxh3-64:other")  # the bug: no check at all
    assert pool.written[[h.index for h in res.handles]].tolist() == [1] + [0] * 7


def test_destination_generation_and_order_are_checked() -> None:
    pool, res, m = setup()
    refs = list(m.dest_pages)
    stale = [PageRef(refs[0].index, refs[0].generation + 1), *refs[1:]]
    with pytest.raises(TransferMismatch, match=r"dest_pages\[0\]"):
        reconcile(dataclasses.replace(m, dest_pages=tuple(stale)), res, pool, m.checksum)
    swapped = [refs[1], refs[0], *refs[2:]]
    with pytest.raises(TransferMismatch, match=r"dest_pages\[0\]"):
        reconcile(dataclasses.replace(m, dest_pages=tuple(swapped)), res, pool, m.checksum)
    with pytest.raises(TransferMismatch, match="dest_pages count"):
        reconcile(dataclasses.replace(m, dest_pages=tuple(refs[:1])), res, pool, m.checksum)


def test_a_reservation_no_longer_current_in_the_ledger_is_refused() -> None:
    pool, res, m = setup()
    pool.release(res.handles)
    pool.allocate(pool.register_owner("next tenant"), 8)
    with pytest.raises(TransferMismatch, match="ledger page") as err:
        reconcile(m, res, pool, m.checksum)
    assert "next tenant" in str(err.value.found)


def test_the_checksum_sees_a_flipped_byte_truncation_and_reordered_or_duplicated_pages() -> None:
    pool, res, _ = setup()
    h = list(res.handles)
    base = payload_checksum(pool, h, TOKENS)
    assert payload_checksum(pool, h, TOKENS) == base  # deterministic
    assert payload_checksum(pool, h, TOKENS - 1) != base
    assert payload_checksum(pool, [h[1], h[0], *h[2:]], TOKENS) != base
    assert payload_checksum(pool, [h[0], h[0], *h[2:]], TOKENS) != base
    # Every single byte matters, in K and V, in every layer (sampled positions).
    for t in (pool.k, pool.v):
        raw = t.view(torch.uint8).reshape(-1)
        for layer in range(GEOM.num_layers):
            page = h[7].index
            tb = GEOM.num_kv_heads * GEOM.head_dim * GEOM.dtype_bytes
            off = (layer * pool.num_pages + page) * GEOM.page_size * tb + 2 * tb - 1
            raw[off] ^= 1
            assert payload_checksum(pool, h, TOKENS) != base
            raw[off] ^= 1
    assert payload_checksum(pool, h, TOKENS) == base


def test_bytes_beyond_the_written_tokens_are_not_covered() -> None:
    pool, res, _ = setup()
    base = payload_checksum(pool, res.handles, TOKENS)
    last = res.handles[7].index
    pool.k[:, last, 2:] += 1  # slots 2, 3 of the last page: past token 30
    assert payload_checksum(pool, res.handles, TOKENS) == base
    pool.k[:, last, 1] += 1
    assert payload_checksum(pool, res.handles, TOKENS) != base
