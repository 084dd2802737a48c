"""One request's KV, ready to leave prefill for decode's reserved pages."""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.engine.messages import PageRef, TransferManifest
from kvfence.engine.sampling import TokenLogprobs
from kvfence.kv.pool import PageHandle


@dataclass(frozen=True, slots=True)
class OutboundTransfer:
    """KV for one request, ready to leave: `src_pages` (this pool) -> `dest_pages` (decode's).

    The transport copies the first `num_tokens` token slots, computes the
    payload checksum, and sends `manifest(checksum)`. Prefill keeps the
    source pages until `PrefillEngine.transfer_done` (I7).
    """

    room: str
    tenant: str
    num_tokens: int
    dest_pages: tuple[PageRef, ...]
    src_pages: tuple[PageHandle, ...]
    first_token: int
    first_logprobs: TokenLogprobs
    cached_tokens: int
    prefill_s: float = 0.0  # first forward step to first token, on the prefill engine

    def manifest(self, checksum: str) -> TransferManifest:
        return TransferManifest(
            room=self.room,
            tenant=self.tenant,
            num_tokens=self.num_tokens,
            num_pages=len(self.src_pages),
            dest_pages=self.dest_pages,
            checksum=checksum,
            first_token=self.first_token,
            first_logprobs=self.first_logprobs,
            cached_tokens=self.cached_tokens,
            prefill_s=self.prefill_s,
        )
