"""A single flipped byte anywhere in a transfer is caught: every byte position, every page.

The payload is the K and V bytes of the prompt's tokens, every layer, every reserved page,
written slots only. Each byte of it is flipped in turn (addressed through the pool's
tensors, not through the checksum's own layout) and must change both checksums decode
compares: the sender's over its pages (`payload_checksum`) and decode's over what landed,
read chunk by chunk as P frames arrive (`ChecksumCursor` over `receive_layout`, chunks of
1,000 bytes: cut mid-page and mid-token). Bytes outside the payload must not change them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvfence.engine.messages import PageRef, TransferManifest
from kvfence.engine.reconcile import byte_views, payload_checksum
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool, PageHandle
from kvfence.transfer.layout import ChecksumCursor, receive_layout

GEOM = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4)
TOKENS = 30  # 8 pages, the last holding 2 tokens
CHUNK = 1000


def setup() -> tuple[KVPool, list[PageHandle], TransferManifest]:
    pool = KVPool(GEOM, 20)
    gen = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    pool.allocate(pool.register_owner("before"), 3)  # the reserved pages are not pages 0..7
    handles = pool.allocate(pool.register_owner("req"), GEOM.pages_for(TOKENS))
    manifest = TransferManifest(
        room="r",
        tenant="acme",
        num_tokens=TOKENS,
        num_pages=len(handles),
        dest_pages=tuple(PageRef(h.index, h.generation) for h in handles),
        checksum="",
        first_token=1,
    )
    return pool, handles, manifest


def landed_checksum(pool: KVPool, manifest: TransferManifest) -> str:
    """Decode's checksum of its own pages, read as a chunked sender's P frames say they landed."""
    runs = receive_layout(pool, manifest)
    cursor = ChecksumCursor(runs, byte_views(pool))
    total = sum(n for *_, n in runs)
    for _ in range(0, total - CHUNK, CHUNK):
        cursor.advance(CHUNK)
    return cursor.finish()


def payload_bytes_by_tensor(pool: KVPool, handles: list[PageHandle]) -> Iterator[torch.Tensor]:
    """A one-byte view of every payload byte, addressed by (K|V, layer, page, slot, byte)."""
    token_bytes = GEOM.num_kv_heads * GEOM.head_dim * GEOM.dtype_bytes
    for t in (pool.k, pool.v):
        for layer in range(GEOM.num_layers):
            for pos, h in enumerate(handles):
                for slot in range(min(GEOM.page_size, TOKENS - pos * GEOM.page_size)):
                    raw = t[layer, h.index, slot].view(torch.uint8).reshape(-1)
                    assert raw.numel() == token_bytes
                    for b in range(token_bytes):
                        yield raw[b : b + 1]


def test_every_payload_byte_flipped_changes_both_checksums() -> None:
    pool, handles, manifest = setup()
    sent = payload_checksum(pool, handles, TOKENS)
    landed = landed_checksum(pool, manifest)
    assert landed == sent  # the two reads agree on an honest transfer
    flipped = 0
    for byte in payload_bytes_by_tensor(pool, handles):
        byte ^= 0x01
        assert payload_checksum(pool, handles, TOKENS) != sent, f"byte {flipped} unseen"
        assert landed_checksum(pool, manifest) != landed, f"byte {flipped} unseen"
        byte ^= 0x01
        flipped += 1
    assert flipped == TOKENS * GEOM.bytes_per_token  # every byte of the payload was tried
    assert payload_checksum(pool, handles, TOKENS) == sent


def test_bytes_outside_the_payload_change_neither_checksum() -> None:
    pool, handles, manifest = setup()
    sent = payload_checksum(pool, handles, TOKENS)
    last = handles[-1].index
    pool.k[:, last, TOKENS % GEOM.page_size :] += 1  # the last page's unwritten slots
    pool.v[:, last, TOKENS % GEOM.page_size :] += 1
    others = [i for i in range(pool.num_pages) if i not in {h.index for h in handles}]
    pool.k[:, others] += 1  # every page not reserved for this transfer
    pool.v[:, others] += 1
    assert payload_checksum(pool, handles, TOKENS) == sent
    assert landed_checksum(pool, manifest) == sent
