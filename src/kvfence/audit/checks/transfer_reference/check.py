"""Transfer references: tenant B must not be served from tenant A's KV by naming A's transfer.

In a disaggregated fleet, prefill hands decode a *reference* to the KV it computed (vLLM:
`kv_transfer_params` with the prefill engine, host, port and block ids). If decode honours a
reference a client sends, any tenant who learns one — from its own prefill answer, or by
reaching a worker directly — is answered from someone else's KV: the incident's class
(decode attending over KV that is not the request's own) without any bug in the pool.

The probe, per route (the public URL and every worker the fleet exposes):

1. Tenant A asks a prefill-capable route for a reference (`do_remote_decode`, 1 token), as
   the fleet's own router does. No route hands one out: no vLLM reference to present (the
   verdict says where it was asked).
2. Tenant B sends its own prompt with A's live reference. B's and A's prompts have equal
   length and the same last tokens, and their greedy continuations (computed beforehand
   under fresh cache salts) differ: so B's answer says, by construction, whose KV decode
   attended. A's continuation → FAIL (the route serves another tenant's KV); neither B's
   own nor A's → FAIL (foreign KV of some other kind, e.g. vLLM's null block); a 4xx, or
   B's own continuation (the field was dropped or overwritten) → the route holds.
3. A reference whose blocks were reused: A prefills a third prompt C into the fleet after
   its reference was read, and B presents the old reference again. C's continuation → FAIL.
4. Poisoning: after a route accepted a foreign reference, an honest request that shares B's
   first blocks (no reference) is compared with its own salted continuation, through the
   public URL and at the route: a difference means the foreign KV entered the prefix cache
   under B's tokens, where every later request with that prefix reads it.
5. SGLang's reference, the bootstrap room (bootstrap.py): B names the room of
   A's transfer at the public URL and at every decode worker. Both probes run on every
   target: a field an engine does not know is refused (kvfence: a 400 naming it) or
   ignored (B's own answer), and either holds.

HTTP only; every request is charged to the audit's budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfence.audit.base import CheckResult, JSONValue, Verdict
from kvfence.audit.checks.transfer_reference.bootstrap import probe_bootstrap
from kvfence.audit.checks.transfer_reference.probe import (
    MAX_TOKENS,
    Outcome,
    Probe,
    Route,
    classify,
    routes_of,
)
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.targets.base import Target, parse_prometheus, samples_named

FIELD = "kv_transfer_params"  # vLLM's transfer reference, in requests and prefill answers
ASK = {"do_remote_decode": True}  # what vllm-router sends prefill to get a reference
SHARED_BLOCKS = 2  # blocks of B's prompt an honest request shares in the poisoning step
DEFAULT_BLOCK = 128  # vLLM's CPU block; the shared prefix is this x SHARED_BLOCKS when unread
TAIL = 40  # tokens after the shared prefix (a partial block: never cached itself)
TAIL_SHARED = 8  # last tokens every probe prompt has in common (decode recomputes the last)
Whose = dict[str, str]  # a prompt's label → that prompt's own continuation ("B": B's own)
DRAWS = 4  # prompt pairs tried until A's and B's continuations differ
ADVICE = (
    "Keep prefill and decode workers off the tenants' network (only the router's address "
    "reachable); the router must overwrite any client-sent transfer reference (vLLM's "
    "kv_transfer_params, SGLang's bootstrap_host/port/room) and workers take them from the "
    "router only (kvfence: the router's credential path), pairing a room only with the "
    "tenant both halves authenticated; send a per-tenant cache_salt so a poisoned prefix "
    "cannot reach another tenant."
)


def reference(probe: Probe, route: Route, prompt: list[int]) -> dict[str, Any] | None:
    """A's transfer reference for `prompt` from a prefill-capable route, or None."""
    probe.asked.append(route.shown)
    r = probe.client(route.url, "a").completion(prompt, max_tokens=1, extra={FIELD: ASK})
    ref = r.json.get(FIELD) if r.ok and isinstance(r.json, dict) else None
    if isinstance(ref, dict) and ref.get("remote_block_ids"):
        return ref
    return None


def present(
    probe: Probe, route: Route, case: str, prompt: list[int], ref: dict[str, Any], whose: Whose
) -> Outcome:
    """B sends `prompt` with `ref`; `whose` maps a tenant's label to its own continuation."""
    r = probe.client(route.url, "b").completion(prompt, max_tokens=MAX_TOKENS, extra={FIELD: ref})
    out = classify(route.shown, case, r, whose)
    probe.outcomes.append(out)
    return out


class TransferReferenceCheck(Check):
    name = "transfer_reference"
    description = (
        "a client-sent transfer reference (vLLM kv_transfer_params, SGLang bootstrap room) "
        "never reads another request's KV"
    )

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client = ctx.client(target, "a")
        target.facts(client)  # sets the model id the routes' clients send
        routes = routes_of(ctx, target, client)
        block = _block_size(ctx, routes)
        shared = SHARED_BLOCKS * (block or DEFAULT_BLOCK)
        probe = Probe(ctx, client.model, shared, tuple(r.url for r in routes))
        last = probe.prompt([], TAIL_SHARED)  # every prompt of the probe ends in these tokens
        giver = None
        for route in (r for r in routes if r.role in ("prefill", "unified", "public")):
            found = _distinct_pair(probe, route, last, shared + TAIL)
            if found is not None:
                giver = route
                self._probe_routes(ctx, probe, routes, giver, found, last)
                break
        probe_bootstrap(probe, routes, last)
        return self._verdict(target, probe, routes, giver)

    def _probe_routes(
        self,
        ctx: AuditContext,
        probe: Probe,
        routes: list[Route],
        giver: Route,
        first: Pair,
        last: list[int],
    ) -> None:
        """Each route gets prompts it has never seen: a prompt the router already carried to
        decode would be served from decode's own prefix cache, whatever reference came with it.
        """
        takers = [r for r in routes if r != giver]
        poisoned: list[tuple[Route, list[int]]] = []
        for i, route in enumerate(takers):
            ctx.progress(f"transfer reference: {route.shown}", i / max(1, len(takers)))
            pair = first if i == 0 else _distinct_pair(probe, giver, last, len(first.pa))
            if pair is None:  # an unprobed route is never a pass (fail closed)
                why = f"not probed: {giver.shown} handed out no further reference"
                probe.outcomes += [Outcome(r.shown, "live", None, "error", why) for r in takers[i:]]
                break
            whose = {"A": pair.own_a, "B": pair.own_b}
            out = present(probe, route, "live", pair.pb, pair.ref, whose)
            if out.verdict in ("leak", "foreign"):
                poisoned.append((route, pair.pb))
                self._reused(probe, route, giver, pair.ref, len(pair.pb), last)
        for route, pb in poisoned:
            self._poisoned(probe, route, routes, pb, last)

    def _reused(
        self, probe: Probe, route: Route, giver: Route, old: dict[str, Any], n: int, last: list[int]
    ) -> None:
        """A's reference, already read once, presented after A prefilled C into the fleet."""
        pc, pb2 = probe.prompt(last, n), probe.prompt(last, n)
        own_c, own_b2 = probe.own(giver, pc, "a"), probe.own(giver, pb2, "b")
        if own_c is None or own_b2 is None or own_c == own_b2:
            return
        if reference(probe, giver, pc) is None:
            return
        present(probe, route, "reused", pb2, old, {"C (A's later prompt)": own_c, "B": own_b2})

    def _poisoned(
        self, probe: Probe, route: Route, routes: list[Route], pb: list[int], last: list[int]
    ) -> None:
        """Honest requests sharing B's first blocks, against their own salted continuation."""
        honest = pb[: probe.shared] + probe.prompt(last, TAIL)
        public = next((r for r in routes if r.role == "public"), route)
        own = probe.own(public, honest, "b")
        if own is None:
            return
        for where in dict.fromkeys((public, route)):
            r = probe.client(where.url, "b").completion(honest, max_tokens=MAX_TOKENS)
            out = classify(where.shown, "poisoned", r, {"B": own})
            if out.verdict == "foreign":
                out.verdict = "leak"
                out.detail = (
                    f"an honest request sharing B's first {probe.shared} tokens, accepted "
                    f"foreign KV at {route.shown} before, got text that is not its own"
                )
            probe.outcomes.append(out)

    def _verdict(
        self, target: Target, probe: Probe, routes: list[Route], giver: Route | None
    ) -> CheckResult:
        bad = [o for o in probe.outcomes if o.verdict in ("leak", "foreign")]
        held = [o for o in probe.outcomes if o.verdict in ("refused", "own")]
        handed = _handed(probe, giver)
        evidence: dict[str, JSONValue] = {
            "reference_from": giver.shown if giver is not None else None,
            "asked": list(probe.asked),
            "routes": [r.shown for r in routes],
            "outcomes": [o.to_json() for o in probe.outcomes],
            "shared_prefix_tokens": probe.shared,
        }
        if not probe.outcomes:
            return self.result(target, Verdict.NOT_APPLICABLE, handed, evidence)
        if bad:
            evidence["advice"] = ADVICE
            where = "; ".join(f"{o.route} ({o.case}): {o.detail}" for o in bad)
            return self.result(
                target,
                Verdict.FAIL,
                "tenant B was served from KV that is not its own by presenting tenant A's "
                f"transfer reference: {where}",
                evidence,
            )
        errors = [o for o in probe.outcomes if o.verdict == "error"]
        if errors or not held:
            where = "; ".join(f"{o.route}: {o.detail}" for o in errors) or "no route was probed"
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"no leak seen, but not every route answered the probe: {where}; {handed}",
                evidence,
            )
        return self.result(
            target,
            Verdict.PASS,
            "tenant A's transfer references (vLLM's `kv_transfer_params`, SGLang's bootstrap "
            "room) were refused or ignored on "
            + ", ".join(sorted({f"{o.route} ({o.case}: {o.verdict})" for o in held}))
            + f"; {handed}",
            evidence,
        )


def _handed(probe: Probe, giver: Route | None) -> str:
    """Where tenant A's vLLM reference came from, or where it was asked for in vain."""
    if giver is not None:
        return f"tenant A's `{FIELD}` reference came from {giver.shown}"
    asked = ", ".join(probe.asked) or "no route"
    return (
        f"no route handed tenant A a `{FIELD}` reference (asked `{FIELD}: "
        f"{{do_remote_decode: true}}` at {asked})"
    )


def _block_size(ctx: AuditContext, routes: list[Route]) -> int | None:
    """The KV block size a node states (vLLM: `vllm:cache_config_info{block_size}`), if any."""
    for route in routes:
        r = ctx.client_for_url(route.url, "a").get("/metrics")
        if not r.ok:
            continue
        for sample in samples_named(parse_prometheus(r.body), "vllm:cache_config_info"):
            size = sample.labels.get("block_size", "")
            if size.isdigit() and int(size) > 0:
                return int(size)
    return None


@dataclass(frozen=True, slots=True)
class Pair:
    """A's and B's prompts (equal length, same last tokens), their own continuations, A's reference."""

    pa: list[int]
    pb: list[int]
    own_a: str
    own_b: str
    ref: dict[str, Any]


def _distinct_pair(probe: Probe, giver: Route, last: list[int], length: int) -> Pair | None:
    """A fresh `Pair` whose continuations differ, or None when `giver` hands out no reference.

    The reference is asked for first: a route that hands none out costs one request. The
    continuations must differ, or B's answer could not say whose KV it came from.
    """
    for _ in range(DRAWS):
        pa, pb = probe.prompt(last, length), probe.prompt(last, length)
        ref = reference(probe, giver, pa)
        if ref is None:
            return None
        own_a, own_b = probe.own(giver, pa, "a"), probe.own(giver, pb, "b")
        if own_a is None or own_b is None:
            return None
        if own_a != own_b:
            return Pair(pa, pb, own_a, own_b, ref)
    return None
