"""Over-long probes are counted by a real /tokenize and grown until over their bound."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfence.audit.base import Budget, Fact
from kvfence.audit.checks.canary.probe_length import TokenCounter, over_bound
from kvfence.audit.client import ProbeClient
from kvfence.audit.prompts import PromptMaker
from kvfence.audit.targets.base import TargetFacts
from kvfence.faults import FaultSet
from kvfence.lab.scenario import TENANT_B, lab_server
from kvfence.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProbeClient]:
    ckpt = make_tiny_checkpoint(Path(tmp_path_factory.mktemp("ckpt")) / "tiny", seed=0)
    with lab_server(ckpt, FaultSet()) as srv:
        c = ProbeClient(srv.url, api_key=srv.keys[TENANT_B], budget=Budget(), model="tiny")
        yield c
        c.close()


def test_a_text_probe_under_its_bound_is_grown_until_the_count_is_over_it(
    client: ProbeClient,
) -> None:
    maker = PromptMaker(client, random.Random(7), use_tokenize=False)
    p = maker.make(120, head="river stone cloud")
    assert p is not None and isinstance(p.payload, str)
    facts = TargetFacts(engine=Fact("kvfence", "test"), tokenizer=Fact("/tokenize", "test"))
    counter = TokenCounter(client, facts)
    first = counter.count(p)
    assert first is not None
    probe = over_bound(maker, counter, "over-pool (pool + 1)", p, first + 20)  # 21 short
    assert probe.verified and probe.tokens is not None and probe.tokens > first + 20
    assert probe.grown_by >= 21 and probe.source == "POST /tokenize on the target"
    assert isinstance(probe.prompt.payload, str)
    # The engine itself counts the grown prompt the same (usage.prompt_tokens).
    r = client.completion(probe.prompt.payload, max_tokens=1)
    assert r.prompt_tokens == probe.tokens, r.brief()


def test_a_probe_nothing_can_count_is_reported_unverified(client: ProbeClient) -> None:
    maker = PromptMaker(client, random.Random(7), use_tokenize=False)
    p = maker.make(60)
    assert p is not None
    counter = TokenCounter(client, TargetFacts(engine=Fact("x", "test")))  # no /tokenize, no nodes
    probe = over_bound(maker, counter, "over-limit (limit + 1)", p, 59)
    assert probe.tokens is None and not probe.verified
    assert probe.to_json([])["verified_over_bound"] is False
    assert probe.source.startswith("nothing")
