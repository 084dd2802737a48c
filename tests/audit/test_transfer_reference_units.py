"""Where the bootstrap-room probe attacks, from the routes a router lists (fast, no server)."""

from __future__ import annotations

import json

from kvfence.audit.checks.transfer_reference.bootstrap import SGLANG_BOOTSTRAP_PORT, attacks_for
from kvfence.audit.checks.transfer_reference.probe import Route, classify
from kvfence.audit.probe_response import ProbeResponse

SECRET = "/r/0123456789abcdef0123456789abcdef"
PUBLIC = Route("http://10.0.0.1:8000", "public")
PREFILL = Route(f"http://10.0.0.2:30000{SECRET}", "prefill", 8998)
DECODE = Route(f"http://10.0.0.3:30001{SECRET}", "decode")


def test_each_decode_worker_is_attacked_as_listed_and_at_its_bare_origin() -> None:
    public, routed, direct = attacks_for([PUBLIC, PREFILL, DECODE])
    assert (public.taker, public.giver) == (PUBLIC.url, None)  # A and B at once, one router
    assert (routed.taker, routed.giver) == (DECODE.url, PREFILL.url)
    assert (direct.taker, direct.giver) == ("http://10.0.0.3:30001", PREFILL.url)
    for attack in (public, routed, direct):  # the room names prefill's listed bootstrap
        assert attack.fields(7) == {
            "bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 7
        }  # fmt: skip
    assert routed.shown == "decode http://10.0.0.3:30001 (the router's path)"
    assert direct.shown == "decode http://10.0.0.3:30001 (direct, without the router's credential)"
    shown = json.dumps([a.shown for a in (public, routed, direct)])
    assert "/r/" not in shown, "a worker's router credential would reach the report"


def test_without_a_listed_bootstrap_only_the_public_url_is_attacked() -> None:
    plain = Route("http://10.0.0.3:30001", "decode")  # no credential in its URL
    (public,) = attacks_for([PUBLIC, Route(PREFILL.url, "prefill"), plain])
    assert public.fields(1)["bootstrap_port"] == SGLANG_BOOTSTRAP_PORT
    assert public.fields(1)["bootstrap_host"] == "10.0.0.1"
    (_, only) = attacks_for([PUBLIC, PREFILL, plain])
    assert only.shown == "decode http://10.0.0.3:30001"  # listed URL is its origin: one attack


def _answer(text: str) -> ProbeResponse:
    return ProbeResponse("POST", "/v1/completions", status=200, texts=[text])


WHOSE = {"A": "acla apost sea", "B": "odel tsav you"}


def test_an_answer_that_follows_a_s_continuation_then_drifts_is_still_a_s_kv() -> None:
    """Decode over transferred pages can break a greedy near-tie unlike prefill did: the answer
    follows A's continuation past where B's differs, then drifts. That is A's KV, named so."""
    drifted = classify("decode x", "live", _answer("acla apXst"), WHOSE)
    assert drifted.verdict == "leak", drifted
    assert "A's continuation for its first 7 characters (B's own shares 0)" in drifted.detail
    exact = classify("decode x", "live", _answer(WHOSE["A"]), WHOSE)
    assert (exact.verdict, exact.detail) == ("leak", "answered with A's continuation")


def test_text_that_is_no_one_s_continuation_stays_foreign_and_b_s_own_stays_own() -> None:
    assert classify("d", "live", _answer("zzzz zzzz"), WHOSE).verdict == "foreign"
    assert classify("d", "live", _answer("acl"), WHOSE).verdict == "foreign"  # too short to say
    assert classify("d", "live", _answer("odel tsav you"), WHOSE).verdict == "own"
    # Closer to B's own than to A's but not B's: KV that is not B's, not attributed to A.
    assert classify("d", "live", _answer("odel tsXXXX"), WHOSE).verdict == "foreign"
