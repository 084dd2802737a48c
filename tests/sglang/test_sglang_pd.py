"""kvfence prefill/decode workers behind the real sglang-router 0.3.2 (PD mode), on loopback.

The router is the Rust router from PyPI in its own process; the workers are
`kvfence serve --router sglang --role prefill|decode`; KV moves over the TCP
transport. One stack per module section (each start is ~15 s on 2 cores).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sgl_helpers import (
    OPERATOR_KEY,
    SCALE,
    Fleet,
    audit_verdicts,
    clean_reject,
    complete,
    edge_verdicts,
    fleet,
    incident,
    over_long_probe,
    text_of,
    wait_quiet,
)

from kvfence.faults import Fault, FaultSet
from kvfence.lab.profiles import INCIDENT_FAULTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hardened(sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(sgl_checkpoint, tmp_path_factory.mktemp("hardened"), keyed_control_plane=False) as f:
        yield f


def test_completion_through_the_router_is_the_tenants_own(hardened: Fleet) -> None:
    prompt = "the quick brown fox jumps over the lazy dog"
    ex = complete(hardened, "tenant-a", prompt, 12, ignore_eos=True)
    assert ex.status == 200, ex.body
    assert ex.reported_prompt_tokens == ex.prompt_tokens
    # The mirror model replays the KV it attends: its own prompt, through the real transfer.
    assert ex.text == hardened.tokenizer.decode(hardened.tokenizer.encode(prompt)[:12])
    assert wait_quiet(hardened, "decode")["integrity"] == "ok"


def test_streaming_and_chat_through_the_router(hardened: Fleet) -> None:
    auth = {"Authorization": f"Bearer {hardened.keys['tenant-b']}"}
    body = {"model": hardened.model, "prompt": "hello there", "max_tokens": 4, "stream": True}
    r = httpx.post(f"{hardened.url}/v1/completions", headers=auth, json=body, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    chat = {"model": hardened.model, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        f"{hardened.url}/v1/chat/completions", headers=auth, json={**chat, "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_over_pool_prompt_is_a_4xx_and_decode_frees_its_reservation(hardened: Fleet) -> None:
    prompt = text_of(hardened.tokenizer, "weather report ", 424)  # > pool 336, < context 512
    ex = complete(hardened, "tenant-b", prompt, 16)
    assert ex.status == 400, ex.body
    assert "336" in ex.text  # prefill's original error, with its limit, through decode
    facts = wait_quiet(hardened, "decode")
    assert (facts["pages_used"], facts["pages_pending"], facts["integrity"]) == (0, 0, "ok")
    after = complete(hardened, "tenant-a", "still served", 4)
    assert after.status == 200, after.body


def test_hardened_stack_turns_the_incident_into_a_clean_error(hardened: Fleet) -> None:
    inc = incident(hardened)
    assert all(a.status == 200 for a in inc.a)
    assert clean_reject(inc), (inc.b.status, inc.b.text[:300])


def test_audit_through_the_router_matches_kvfences_own_edge(
    hardened: Fleet, sgl_checkpoint: Path, tmp_path: Path
) -> None:
    routed = audit_verdicts(hardened.operator_url, hardened.keys, OPERATOR_KEY, tmp_path / "r.json")
    edge = edge_verdicts(sgl_checkpoint, FaultSet(), tmp_path / "e.json")
    assert routed == edge, (routed, edge)
    assert routed["canary"] == routed["boundary"] == "pass"
    # Here max_input (335) < pool: the limit + 1 probe is the reject probe. Through the router it
    # is text, counted on the prefill worker's /tokenize and provably over the limit.
    probe = over_long_probe(tmp_path / "r.json", "limit")
    assert probe["verified_over_bound"] and probe["prompt_tokens"] > probe["bound"], probe
    assert "/tokenize on prefill worker" in probe["measured_by"], probe
    assert "/r/" not in probe["measured_by"], "the router credential (worker URL path) leaked"


def test_bootstrap_fields_and_rid_from_a_tenant_are_refused(hardened: Fleet) -> None:
    key = {"Authorization": f"Bearer {hardened.keys['tenant-a']}"}
    base = {"model": hardened.model, "prompt": "hi", "max_tokens": 2}
    for role in ("prefill", "decode"):
        url = hardened.worker(role).url  # the worker's own URL: no router credential
        for field, value in (("bootstrap_room", 7), ("bootstrap_host", "10.0.0.1")):
            r = httpx.post(f"{url}/v1/completions", headers=key, json={**base, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = httpx.post(f"{url}/v1/completions", headers=key, json=base)
        assert r.status_code == 400 and r.json()["error"]["code"] == "pd_worker_direct"
        forged = url + "/r/" + "0" * 32  # a guessed credential is no credential
        r = httpx.post(f"{forged}/v1/completions", headers=key, json=base)
        assert r.status_code == 404
    # Through the stack's public address: the edge refuses a client's rid (I9).
    r = httpx.post(f"{hardened.url}/v1/completions", headers=key, json={**base, "rid": "x"})
    assert r.status_code == 400 and "rid" in r.text


def test_a_room_is_bound_to_the_tenant_both_workers_authenticated(hardened: Fleet) -> None:
    """Halves of one room from two tenants (on the router's path) are refused, never paired (I9)."""
    prefill, decode = hardened.worker("prefill"), hardened.worker("decode")
    room = {"bootstrap_room": 4242, "bootstrap_host": "127.0.0.1"}
    room["bootstrap_port"] = prefill.bootstrap_port
    body = {"model": hardened.model, "prompt": "a private prompt", "max_tokens": 4, **room}
    results: dict[str, httpx.Response] = {}

    def post(role: str, url: str, tenant: str) -> None:
        key = {"Authorization": f"Bearer {hardened.keys[tenant]}"}
        results[role] = httpx.post(f"{url}/v1/completions", headers=key, json=body, timeout=60)

    halves = [
        threading.Thread(
            target=post, args=("decode", hardened.stack.router_url_of(decode), "tenant-a")
        ),
        threading.Thread(
            target=post, args=("prefill", hardened.stack.router_url_of(prefill), "tenant-b")
        ),
    ]
    for t in halves:
        t.start()
    for t in halves:
        t.join(90)
    for role in ("prefill", "decode"):
        r = results[role]
        assert r.status_code == 409 and r.json()["error"]["code"] == "room_mismatch", (role, r.text)
    facts = wait_quiet(hardened, "decode")
    assert (facts["pages_used"], facts["pages_pending"], facts["integrity"]) == (0, 0, "ok")


def test_engine_reject_path_reaches_decode_through_the_bootstrap_channel(
    sgl_checkpoint: Path, tmp_path: Path
) -> None:
    """The edge limit off (undersized-pool): prefill's engine rejects, decode hears it at once."""
    with fleet(sgl_checkpoint, tmp_path, FaultSet.of(Fault.UNDERSIZED_POOL)) as f:
        inc = incident(f)
        assert clean_reject(inc), (inc.b.status, inc.b.text[:300])
        facts = wait_quiet(f, "decode")
        assert (facts["pages_used"], facts["pages_pending"], facts["integrity"]) == (0, 0, "ok")


def test_incident_profile_leaks_through_the_real_router(
    sgl_checkpoint: Path, tmp_path: Path
) -> None:
    """The proof the checks above can fail: the Workers AI faults re-create the leak here."""
    faults = FaultSet.of(*INCIDENT_FAULTS)
    with fleet(sgl_checkpoint, tmp_path, faults, keyed_control_plane=False) as f:
        inc = incident(f)
        routed = audit_verdicts(f.operator_url, f.keys, OPERATOR_KEY, tmp_path / "r.json")
    # `kvfence audit` at the router sees what it sees at kvfence's own edge: the leak is red.
    edge = edge_verdicts(sgl_checkpoint, faults, tmp_path / "e.json")
    # Canary too: through this router its prompts are text; its `pool + 1` probe is counted on
    # a prefill worker's /tokenize and grown until provably over the pool, and it runs right
    # after A's request (before a short B request reuses A's freed pages).
    same = ("capacity", "boundary", "counters", "canary")
    assert {c: routed[c] for c in same} == {c: edge[c] for c in same}, (routed, edge)
    assert routed["boundary"] == "fail" and routed["canary"] == "fail", (routed, edge)
    probe = over_long_probe(tmp_path / "r.json", "pool")
    assert probe["verified_over_bound"] and probe["prompt_tokens"] > SCALE.prefill_pool_tokens
    assert probe["prompt_tokens"] < SCALE.context_length, probe  # over the pool, in the limit
    # The engine's own count (it answered 200: the overflow path) agrees with the measured one.
    assert probe["prompt_tokens"] in probe["usage_prompt_tokens"], probe
    assert not clean_reject(inc)
    assert inc.b.status == 200
    assert inc.b.reported_prompt_tokens == inc.b.prompt_tokens  # B's own count, like the incident
    assert inc.leaked is not None, inc.b.text[:300]  # A's sentinel in B's answer
    assert SCALE.prefill_pool_tokens < inc.b.prompt_tokens < SCALE.context_length


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_real_transports_behind_the_router(
    sgl_checkpoint: Path, tmp_path: Path, hardened: Fleet, transport: str
) -> None:
    """Mooncake (TCP here) and NIXL (UCX) move the KV: the same greedy text as over TCP."""
    pytest.importorskip("mooncake.engine" if transport == "mooncake" else "nixl_cu12")
    prompt = "pack my box with five dozen liquor jugs"
    want = complete(hardened, "tenant-a", prompt, 10, ignore_eos=True)
    with fleet(sgl_checkpoint, tmp_path, transport=transport) as f:
        got = complete(f, "tenant-a", prompt, 10, ignore_eos=True)
        over = complete(f, "tenant-b", text_of(f.tokenizer, "weather report ", 424), 16)
        facts = wait_quiet(f, "decode")
        assert f.facts("decode")["disaggregation_transfer_backend"] == transport
    assert (got.status, got.text) == (200, want.text), got.body
    assert over.status == 400, over.body
    assert (facts["pages_used"], facts["pages_pending"], facts["integrity"]) == (0, 0, "ok")


@pytest.mark.parametrize("shared", [False, True], ids=["namespaced", "shared-prefix-cache"])
def test_prefix_sharing_through_the_text_only_router_is_decided(
    sgl_checkpoint: Path, tmp_path: Path, shared: bool
) -> None:
    """The router refuses token ids (422): the check falls back to text and still decides."""
    faults = FaultSet.of(Fault.SHARED_PREFIX_CACHE) if shared else FaultSet()
    with fleet(sgl_checkpoint, tmp_path, faults, prefix_cache=True, keyed_control_plane=False) as f:
        out = tmp_path / "r.json"
        routed = audit_verdicts(f.operator_url, f.keys, OPERATOR_KEY, out, checks="prefix_sharing")
    rep = json.loads(out.read_text())
    ev = next(r for r in rep["results"] if r["check"] == "prefix_sharing")["evidence"]
    assert ev["prompts"].startswith("random words"), ev["prompts"]
    assert ev["unsalted"]["verdict"] == ("fail" if shared else "pass"), ev["unsalted"]
    # Overall red either way: this router drops cache_salt on chat (test_sglang_salt_audit.py).
    assert routed["prefix_sharing"] == "fail", ev
    assert ev["salt_within_tenant"]["chat"]["verdict"] == "fail", ev["salt_within_tenant"]
