"""B's repeats under load start only once A's load is running (every A thread has sent, some
have finished): a first repeat that races A's first request is not "under load", and on the
lab it is the one repeat that cannot diverge (the demo's Fisher test needs all of them)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from kvfence.audit.checks.noninterference.probes import Answer, Load, NoninterferenceConfig, Probes
from kvfence.audit.contract import AuditContext
from kvfence.audit.probe_response import ProbeResponse


class _Engine:
    """Answers completions after a delay; A's are slow, so a racing B repeat would win."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.a_done = 0
        self.b_sent_after: list[int] = []  # A completions seen when each B repeat was sent

    def completion(self, prompt: list[int], **kw: Any) -> ProbeResponse:
        tenant = "a" if kw.get("temperature") == 1.0 else "b"
        if tenant == "b":
            with self.lock:
                self.b_sent_after.append(self.a_done)
        time.sleep(0.2 if tenant == "a" else 0.01)
        if tenant == "a":
            with self.lock:
                self.a_done += 1
        return ProbeResponse("POST", "/v1/completions", status=200, texts=["same"])


def test_under_load_waits_for_the_load_to_run() -> None:
    engine = _Engine()
    cfg = NoninterferenceConfig(repeats=2, load_concurrency=3)
    probes = Probes(engine, cfg, None)  # type: ignore[arg-type]  # duck-typed client
    probes.prompts, probes.refs = [[1, 2, 3]], [Answer((), "same", ())]
    load = Load(engine, cfg, random.Random(0))  # type: ignore[arg-type]
    loaded = probes.under_load(AuditContext(), load)
    assert loaded.total == cfg.repeats
    assert engine.b_sent_after and min(engine.b_sent_after) >= cfg.load_concurrency, (
        engine.b_sent_after
    )
