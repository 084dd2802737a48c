"""The building thread keeps one intra-op thread; the engine thread runs the role's (engine/threads.py)."""

from __future__ import annotations

import threading

import torch
from runtime_helpers import PAGE, Models, greedy, work

from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import Failure, TokenChunk
from kvfence.engine.threads import keep_one_for_engine
from kvfence.serve.pipeline import CollectingSink, LocalPipeline
from kvfence.transfer.link import inprocess_link


class _ThreadsSeen(CollectingSink):
    """Records, on the engine thread that delivers each event, that thread's intra-op threads."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __call__(self, event: TokenChunk | Failure) -> None:
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        super().__call__(event)


def test_the_engine_thread_alone_runs_the_roles_threads(models: Models) -> None:
    before = torch.get_num_threads()
    try:
        engine_threads = keep_one_for_engine(3)
        assert engine_threads == 3
        assert torch.get_num_threads() == 1  # the building thread never starts a team
        config = EngineConfig(prefill_pages=64, decode_pages=128, page_size=PAGE)
        geometry = models.config.kv_geometry(page_size=PAGE)
        pipe = LocalPipeline(
            models.llama, geometry, config, kv_link=inprocess_link, torch_threads=engine_threads
        )
        sink = _ThreadsSeen()
        pipe.start()
        try:
            pipe.submit(work("room-1", "tenant-a", range(5, 25), greedy(3)), sink)
            assert len(sink.wait(timeout=60).token_ids) == 3
        finally:
            pipe.stop()
        assert sink.seen and set(sink.seen) == {("kvfence-engine", 3)}
        assert torch.get_num_threads() == 1  # the engine's setting stayed on its thread
        assert keep_one_for_engine(0) == 1  # 0: the calling thread's own setting
    finally:
        torch.set_num_threads(before)
