"""SGLang's transfer reference: tenant B names the bootstrap room of tenant A's transfer.

SGLang pairs the two halves of a request by room: its router sends one body to a
prefill and a decode worker with `bootstrap_host`/`bootstrap_port` (the prefill
worker's bootstrap channel) and `bootstrap_room` added; decode registers the room there
and decodes over whatever prefill computed for it. A worker that takes these fields
from a client serves the client from whichever transfer holds the room it names. The
attack for each layout:

- the public URL: A and B name the same room at once (an SGLang client may choose its
  own). A router that keeps a client's room pairs them; one that overwrites it
  (sglang-router 0.3.2) or refuses the fields (kvfence's edge and hub) does not;
- every decode worker, as the router lists it and, where that URL carries the router's
  credential in its path, at its bare origin (what a tenant on the workers' network
  reaches): B names the room A's request holds at a prefill worker the router lists,
  with that worker's bootstrap address.

Live: B's half first, then A's (each half waits for the other; a route that refuses
B's fields answers at once, and A's half is then not sent). Reused: after that room's
transfer ended, A's next prompt C takes the same room and B names it again: a room is
released and drawn again, and must never pair with a request that is not its owner's.
Whose KV, by construction (probe.py): C's or A's continuation → leak; a 4xx or
B's own continuation → the route holds.

HTTP only; every request is charged to the audit's budget.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvfence.audit.checks.transfer_reference.probe import (
    MAX_TOKENS,
    Outcome,
    Probe,
    Prompt,
    Route,
    classify,
)
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.fleet import origin

ROOM_BITS = 63  # SGLang's routers draw rooms below 2**63
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's default: named at the public URL where none is listed
LENGTH = 64  # tokens per prompt: several pages at any page size, far inside any pool
DRAWS = 4  # prompt pairs tried until A's and B's continuations differ
# How long B's half may wait alone before A's is sent, as a multiple of the slowest full
# request seen (a refusal comes sooner than an answer), and never less than the floor.
PATIENCE_FACTOR = 2.0
PATIENCE_FLOOR_S = 1.0


@dataclass(frozen=True, slots=True)
class Attack:
    taker: str  # the URL B presents the room at
    shown: str  # how the report names that route (origin only: a path may be a credential)
    giver: str | None  # the URL A's half of the room goes to; None: `taker`, both at once
    host: str
    port: int

    def fields(self, room: int) -> dict[str, Any]:
        return {"bootstrap_host": self.host, "bootstrap_port": self.port, "bootstrap_room": room}


@dataclass(frozen=True, slots=True)
class Pair:
    """Two prompts (equal length, same last tokens) and their own, differing continuations."""

    pa: Prompt
    pb: Prompt
    own_a: str
    own_b: str


def probe_bootstrap(probe: Probe, routes: list[Route], last: list[int]) -> None:
    """Every layout's attack; the outcomes are added to `probe.outcomes`."""
    public = routes[0]
    attacks = attacks_for(routes)
    for i, attack in enumerate(attacks):
        probe.ctx.progress(
            f"transfer reference: bootstrap room at {attack.shown}", i / len(attacks)
        )
        _attack(probe, public, attack, last)


def attacks_for(routes: list[Route]) -> list[Attack]:
    """The public URL's attack, then each decode worker's (listed URL, then bare origin)."""
    public = routes[0]
    prefill = next((r for r in routes if r.role == "prefill" and r.bootstrap_port), None)
    if prefill is not None and prefill.bootstrap_port is not None:
        host, port = urlsplit(prefill.url).hostname or "", prefill.bootstrap_port
    else:
        host, port = urlsplit(public.url).hostname or "", SGLANG_BOOTSTRAP_PORT
    out = [Attack(public.url, public.shown, None, host, port)]
    if prefill is None:
        return out  # no listed bootstrap channel: no room at a worker to name
    for decode in (r for r in routes if r.role == "decode"):
        credentialed = urlsplit(decode.url).path not in ("", "/")
        shown = f"{decode.shown} (the router's path)" if credentialed else decode.shown
        out.append(Attack(decode.url, shown, prefill.url, host, port))
        if credentialed:
            bare = f"{decode.shown} (direct, without the router's credential)"
            out.append(Attack(origin(decode.url), bare, prefill.url, host, port))
    return out


def _attack(probe: Probe, public: Route, attack: Attack, last: list[int]) -> None:
    room = probe.ctx.rng.getrandbits(ROOM_BITS)
    first = _pair(probe, public, last)
    if first is None:
        why = (
            f"not probed: no two prompts with differing own continuations at {public.shown}"
            f" ({probe.last_error or f'{DRAWS} pairs answered alike'})"
        )
        probe.outcomes.append(Outcome(attack.shown, "bootstrap-live", None, "error", why))
        return
    r = _race(probe, attack, first.pa, first.pb, room)
    live = classify(attack.shown, "bootstrap-live", r, {"A": first.own_a, "B": first.own_b})
    probe.outcomes.append(live)
    if live.verdict == "refused":
        return  # the fields themselves were refused: a reused room is refused the same way
    again = _pair(probe, public, last)
    if again is None:
        return
    r = _race(probe, attack, again.pa, again.pb, room)
    whose = {"C (A's later prompt)": again.own_a, "B": again.own_b}
    probe.outcomes.append(classify(attack.shown, "bootstrap-reused", r, whose))


def _pair(probe: Probe, public: Route, last: list[int]) -> Pair | None:
    """Fresh prompts, as text where the target can say which text is exactly those tokens
    (routers that take text only), with their own continuations through the public URL. A
    draw whose text does not tokenize back to its ids is sent as ids, which a text-only
    router refuses: the next draw is tried."""
    for _ in range(DRAWS):
        ids_a, ids_b = probe.prompt(last, LENGTH), probe.prompt(last, LENGTH)
        text_a, text_b = probe.text(ids_a), probe.text(ids_b)
        pa: Prompt = text_a if text_a is not None and text_b is not None else ids_a
        pb: Prompt = text_b if text_a is not None and text_b is not None else ids_b
        own_a = probe.own(public, pa, "a")
        own_b = probe.own(public, pb, "b") if own_a is not None else None
        if own_a is not None and own_b is not None and own_a != own_b:
            return Pair(pa, pb, own_a, own_b)
    return None


def _race(probe: Probe, attack: Attack, pa: Prompt, pb: Prompt, room: int) -> ProbeResponse:
    """B's answer when B and A name the same room (A's half at the giver)."""
    fields = attack.fields(room)
    b = probe.client(attack.taker, "b")
    a = probe.client(attack.giver or attack.taker, "a")

    def send(client: ProbeClient, prompt: Prompt) -> ProbeResponse:
        return client.completion(prompt, max_tokens=MAX_TOKENS, extra=fields)

    with ThreadPoolExecutor(max_workers=2) as pool:
        if attack.giver is None:  # two clients of one router, at once
            fa, fb = pool.submit(send, a, pa), pool.submit(send, b, pb)
            fa.result()
            return fb.result()
        fb = pool.submit(send, b, pb)
        patience = max(PATIENCE_FLOOR_S, PATIENCE_FACTOR * probe.slowest_s)
        try:
            return fb.result(timeout=patience)  # answered alone: refused, or served unpaired
        except TimeoutError:
            pass
        fa = pool.submit(send, a, pa)
        rb = fb.result()
        fa.result()
        return rb
