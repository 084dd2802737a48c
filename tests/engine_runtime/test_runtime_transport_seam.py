"""The pipeline's KV-copy seam carries the serve/transfer in-process transport unchanged."""

from __future__ import annotations

from runtime_helpers import PAGE, Models, assert_quiet_and_empty, greedy, run, work

from kvfence.engine.decode import DecodeEngine
from kvfence.engine.pipeline import LocalPipeline
from kvfence.engine.prefill import OutboundTransfer
from kvfence.faults import FaultSet
from kvfence.kv.pool import KVPool
from kvfence.serve.transfer.base import Landed, ManifestFields, TransferRefused
from kvfence.serve.transfer.inprocess import InProcessTransport


class TransportCopy:
    """Adapter: a `serve.transfer` backend behind the pipeline's `KVCopy` seam."""

    def __init__(self, decode_pool: KVPool, *, short: bool = False) -> None:
        transport = InProcessTransport()
        self.receiver = transport.receiver(decode_pool)
        self.sender = transport.sender(self.receiver.address)
        self.window = self.receiver
        self.short = short

    def send(self, transfer: OutboundTransfer, src: KVPool, decode: DecodeEngine) -> bool:
        n = 16 if self.short else transfer.num_tokens  # `short`: the #30233 one-page transfer
        fields = ManifestFields(
            transfer.tenant, transfer.first_token, transfer.first_logprobs, transfer.cached_tokens
        )
        try:
            self.sender.send(transfer.room, src, transfer.src_pages, n, transfer.dest_pages, fields)
        except TransferRefused:
            return False
        return True

    def poll(self, decode: DecodeEngine) -> bool:
        events = self.receiver.poll()  # ends inbound windows itself (I7)
        for event in events:
            if isinstance(event, Landed):
                decode.on_transfer(event.manifest, event.checksum)
            elif not event.ok:
                decode.abort(event.room, "KV transfer did not complete")
        return bool(events)


def pipeline(models: Models, *, short: bool = False) -> LocalPipeline:
    return LocalPipeline(
        models.mirror,
        models.config.kv_geometry(page_size=PAGE),
        models.pipeline().config,
        FaultSet(),
        kv_copy=lambda pool: TransportCopy(pool, short=short),
    )


def test_transport_backed_pipeline_echoes_and_cleans_up(models: Models) -> None:
    pipe = pipeline(models)
    prompts = [list(range(10 + i, 60 + 7 * i)) for i in range(4)]
    results = run(pipe, [work(f"r{i}", f"t{i}", p, greedy(12)) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results, strict=True):
        assert r.error is None and r.token_ids == p[:12]
    pipe.abort("gone", "never existed")
    pipe.drive()
    assert_quiet_and_empty(pipe)


def test_transport_backed_pipeline_refuses_a_short_transfer(models: Models) -> None:
    pipe = pipeline(models, short=True)
    (r,) = run(pipe, [work("r", "t", list(range(10, 74)), greedy(12))])
    assert r.error is not None and r.error.status == 502 and "num_tokens" in r.error.message
    assert pipe.stats().transfer_mismatches == 1
    assert_quiet_and_empty(pipe)
