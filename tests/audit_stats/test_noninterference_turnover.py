"""Between two B repeats under load, an A request that began after B's previous answer has
ended: A took, wrote and released pages in between, by construction. Without it, on a fast
engine A's release and its next request's reservation cancel out between two B repeats
(LIFO reuse), B's long probe reads its own earlier page, and the lab's leak showed on only
1-5 of 9 repeats at load 4-7 (the Fisher test needs all 9)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any

from kvfence.audit.checks.noninterference.probes import Answer, Load, NoninterferenceConfig, Probes
from kvfence.audit.contract import AuditContext
from kvfence.audit.probe_response import ProbeResponse


class _Engine:
    """Records the order of events: A begins and ends, B sends and answers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clock = itertools.count()
        self.a_spans: list[tuple[int, int]] = []  # (began, ended) of each A request
        self.b_spans: list[tuple[int, int]] = []  # (sent, answered) of each B repeat

    def completion(self, prompt: list[int], **kw: Any) -> ProbeResponse:
        with self.lock:
            began = next(self.clock)
        time.sleep(0.03 if kw.get("temperature") == 1.0 else 0.001)  # B's answer is quick
        with self.lock:
            span = (began, next(self.clock))
            (self.a_spans if kw.get("temperature") == 1.0 else self.b_spans).append(span)
        return ProbeResponse("POST", "/v1/completions", status=200, texts=["same"])


def test_every_b_repeat_follows_a_whole_a_request() -> None:
    engine = _Engine()
    cfg = NoninterferenceConfig(repeats=4, load_concurrency=3)
    probes = Probes(engine, cfg, None)  # type: ignore[arg-type]  # duck-typed client
    probes.prompts, probes.refs = [[1, 2, 3], [4, 5, 6]], [Answer((), "same", ())] * 2
    load = Load(engine, cfg, random.Random(0))  # type: ignore[arg-type]
    loaded = probes.under_load(AuditContext(), load)
    assert loaded.total == 2 * cfg.repeats
    for (_, answered), (sent, _) in itertools.pairwise(sorted(engine.b_spans)):
        assert any(answered < began and ended < sent for began, ended in engine.a_spans), (
            answered,
            sent,
        )
    assert load.waits_timed_out == 0
