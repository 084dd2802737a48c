"""Transfer references: tenant B must not be served from tenant A's KV by naming A's transfer.

In a disaggregated fleet, prefill hands decode a *reference* to the KV it computed (vLLM:
`kv_transfer_params` with the prefill engine, host, port and block ids). If decode honours a
reference a client sends, any tenant who learns one — from its own prefill answer, or by
reaching a worker directly — is answered from someone else's KV: the incident's class
(decode attending over KV that is not the request's own) without any bug in the pool.

The probe, per route (the public URL and every worker the fleet exposes):

1. Tenant A asks a prefill-capable route for a reference (`do_remote_decode`, 1 token), as
   the fleet's own router does. No route hands one out: nothing to test (NOT_APPLICABLE,
   saying where it was asked).
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

HTTP only; every request is charged to the audit's budget.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.base import AuditContext, Check, CheckResult, JSONValue, Verdict
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.fleet import origin, parse_workers
from kvfence.audit.prompts import random_words
from kvfence.audit.targets.base import Target, parse_prometheus, samples_named

FIELD = "kv_transfer_params"  # vLLM's transfer reference, in requests and prefill answers
ASK = {"do_remote_decode": True}  # what vllm-router sends prefill to get a reference
MAX_TOKENS = 8  # the greedy continuation that tells whose KV was read
SHARED_BLOCKS = 2  # blocks of B's prompt an honest request shares in the poisoning step
DEFAULT_BLOCK = 128  # vLLM's CPU block; the shared prefix is this x SHARED_BLOCKS when unread
TAIL = 40  # tokens after the shared prefix (a partial block: never cached itself)
TAIL_SHARED = 8  # last tokens every probe prompt has in common (decode recomputes the last)
TOKEN_RANGE = (10, 250)  # byte-level ids every byte-level BPE vocabulary holds
DRAWS = 4  # prompt pairs tried until A's and B's continuations differ
ADVICE = (
    "Keep prefill and decode workers off the tenants' network (only the router's address "
    "reachable); the router must overwrite any client-sent transfer reference; send a "
    "per-tenant cache_salt so a poisoned prefix cannot reach another tenant."
)


@dataclass(frozen=True, slots=True)
class Route:
    url: str  # full URL used to reach it (may carry a router credential in its path)
    role: str  # public | prefill | decode | unified

    @property
    def shown(self) -> str:
        return f"{self.role} {origin(self.url)}"


@dataclass(slots=True)
class Outcome:
    route: str
    case: str  # live | reused | poisoned
    status: int | None
    verdict: str  # leak | foreign | refused | own | error
    detail: str
    text: str = ""
    expected: dict[str, str] = field(default_factory=dict)  # label → that prompt's own answer

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "route": self.route,
            "case": self.case,
            "status": self.status,
            "verdict": self.verdict,
            "detail": self.detail,
            "answer": self.text[:120],
            "own_continuations": {k: v[:120] for k, v in self.expected.items()},
        }


@dataclass(slots=True)
class Probe:
    """State of one run: the prompts, their own continuations, what each route did."""

    ctx: AuditContext
    model: str | None
    shared: int
    tokenizers: tuple[str, ...] = ()  # route URLs asked for /tokenize, in order
    outcomes: list[Outcome] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)

    def client(self, url: str, tenant: str) -> ProbeClient:
        c = self.ctx.client_for_url(url, "a" if tenant == "a" else "b")
        if c.model is None:
            c.model = self.model
        return c

    def prompt(self, tail: list[int], length: int) -> list[int]:
        """`length` token ids ending in `tail`: random words as the target tokenizes them.

        Prompts that end in the same tokens leave an engine's incremental detokenizer in the
        same state, so the same generated ids read as the same text whoever's prompt came
        first (an id that is half a UTF-8 character otherwise carries bytes of the *prompt*
        into the answer's text).
        """
        head = length - len(tail)
        words = random_words(self.ctx.rng, length)
        for url in self.tokenizers:
            ids = self.client(url, "a").tokenize(words)
            if ids and len(ids) >= head:
                return ids[:head] + tail
        lo, hi = TOKEN_RANGE
        return [self.ctx.rng.randrange(lo, hi) for _ in range(head)] + tail

    def own(self, route: Route, prompt: list[int], tenant: str) -> str | None:
        """The prompt's greedy continuation with nothing cached (a fresh cache salt)."""
        salt = {"cache_salt": f"kvfence-audit-{secrets.token_hex(8)}"}
        r = self.client(route.url, tenant).completion(prompt, max_tokens=MAX_TOKENS, extra=salt)
        if r.status in (400, 422):  # no cache_salt on this engine: the plain answer
            r = self.client(route.url, tenant).completion(prompt, max_tokens=MAX_TOKENS)
        return r.texts[0] if r.ok and r.texts else None

    def reference(self, route: Route, prompt: list[int]) -> dict[str, Any] | None:
        """A's transfer reference for `prompt` from a prefill-capable route, or None."""
        self.asked.append(route.shown)
        r = self.client(route.url, "a").completion(prompt, max_tokens=1, extra={FIELD: ASK})
        ref = r.json.get(FIELD) if r.ok and isinstance(r.json, dict) else None
        if isinstance(ref, dict) and ref.get("remote_block_ids"):
            return ref
        return None

    def present(
        self, route: Route, case: str, prompt: list[int], ref: dict[str, Any], whose: dict[str, str]
    ) -> Outcome:
        """B sends `prompt` with `ref`; `whose` maps a tenant's label to its own continuation."""
        r = self.client(route.url, "b").completion(
            prompt, max_tokens=MAX_TOKENS, extra={FIELD: ref}
        )
        out = classify(route.shown, case, r, whose)
        self.outcomes.append(out)
        return out


def classify(route: str, case: str, r: ProbeResponse, whose: dict[str, str]) -> Outcome:
    """What B's answer proves: whose continuation it is (`whose`: label → text; "B" is B's own)."""
    if r.status is None:
        return Outcome(route, case, None, "error", f"no answer: {r.error}")
    if 400 <= r.status < 500:
        return Outcome(route, case, r.status, "refused", "the reference was refused")
    if r.status >= 500 or not r.texts:
        return Outcome(route, case, r.status, "error", f"server error: {r.body[:160]}")
    out = _classify_text(route, case, r.texts[0], whose)
    out.expected = dict(whose)
    return out


def _classify_text(route: str, case: str, text: str, whose: dict[str, str]) -> Outcome:
    for label, own in whose.items():
        if text == own:
            if label == "B":
                return Outcome(route, case, 200, "own", "answered from B's own KV", text)
            return Outcome(route, case, 200, "leak", f"answered with {label}'s continuation", text)
    others = " nor ".join(label for label in whose if label != "B")
    return Outcome(
        route,
        case,
        200,
        "foreign",
        f"answered with text that is neither B's own continuation nor {others}'s: KV that is "
        "not B's (another request's, or never written)",
        text,
    )


class TransferReferenceCheck(Check):
    name = "transfer_reference"
    description = "a client-sent transfer reference (vLLM kv_transfer_params) never reads another request's KV"

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client = ctx.client(target, "a")
        target.facts(client)  # sets the model id the routes' clients send
        routes = _routes(ctx, target, client)
        block = _block_size(ctx, routes)
        shared = SHARED_BLOCKS * (block or DEFAULT_BLOCK)
        probe = Probe(ctx, client.model, shared, tuple(r.url for r in routes))
        length = shared + TAIL
        last = probe.prompt([], TAIL_SHARED)  # every prompt of the probe ends in these tokens
        givers = [r for r in routes if r.role in ("prefill", "unified", "public")]
        for giver in givers:
            found = _distinct_pair(probe, giver, last, length)
            if found is not None:
                return self._probe_routes(ctx, target, probe, routes, giver, found, last)
        return self.result(
            target,
            Verdict.NOT_APPLICABLE,
            f"no route handed tenant A a transfer reference (asked `{FIELD}: "
            f"{{do_remote_decode: true}}` at {', '.join(probe.asked) or 'no route'}): "
            "there is no reference for another tenant to present",
            {"routes": [r.shown for r in routes], "asked": list(probe.asked)},
        )

    def _probe_routes(
        self,
        ctx: AuditContext,
        target: Target,
        probe: Probe,
        routes: list[Route],
        giver: Route,
        first: Pair,
        last: list[int],
    ) -> CheckResult:
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
            out = probe.present(
                route, "live", pair.pb, pair.ref, {"A": pair.own_a, "B": pair.own_b}
            )
            if out.verdict in ("leak", "foreign"):
                poisoned.append((route, pair.pb))
                self._reused(probe, route, giver, pair.ref, len(pair.pb), last)
        for route, pb in poisoned:
            self._poisoned(probe, route, routes, pb, last)
        return self._verdict(target, probe, routes, giver)

    def _reused(
        self, probe: Probe, route: Route, giver: Route, old: dict[str, Any], n: int, last: list[int]
    ) -> None:
        """A's reference, already read once, presented after A prefilled C into the fleet."""
        pc, pb2 = probe.prompt(last, n), probe.prompt(last, n)
        own_c, own_b2 = probe.own(giver, pc, "a"), probe.own(giver, pb2, "b")
        if own_c is None or own_b2 is None or own_c == own_b2:
            return
        if probe.reference(giver, pc) is None:
            return
        probe.present(route, "reused", pb2, old, {"C (A's later prompt)": own_c, "B": own_b2})

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
        self, target: Target, probe: Probe, routes: list[Route], giver: Route
    ) -> CheckResult:
        bad = [o for o in probe.outcomes if o.verdict in ("leak", "foreign")]
        held = [o for o in probe.outcomes if o.verdict in ("refused", "own")]
        evidence: dict[str, JSONValue] = {
            "reference_from": giver.shown,
            "routes": [r.shown for r in routes],
            "outcomes": [o.to_json() for o in probe.outcomes],
            "shared_prefix_tokens": probe.shared,
        }
        if bad:
            evidence["advice"] = ADVICE
            where = "; ".join(f"{o.route} ({o.case}): {o.detail}" for o in bad)
            return self.result(
                target,
                Verdict.FAIL,
                f"tenant B was served from KV that is not its own by presenting tenant A's "
                f"transfer reference: {where}",
                evidence,
            )
        errors = [o for o in probe.outcomes if o.verdict == "error"]
        if errors or not held:
            where = "; ".join(f"{o.route}: {o.detail}" for o in errors) or "no route was probed"
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"no leak seen, but not every route answered the probe: {where}",
                evidence,
            )
        return self.result(
            target,
            Verdict.PASS,
            f"tenant A's transfer reference (from {giver.shown}) was refused or ignored on "
            + ", ".join(sorted({f"{o.route} ({o.verdict})" for o in held})),
            evidence,
        )


def _routes(ctx: AuditContext, target: Target, client: ProbeClient) -> list[Route]:
    """The public URL, then every worker the router lists and every `--worker` given."""
    routes = [Route(target.url, "public")]
    listed = client.get("/workers")
    workers = parse_workers(listed.json) if listed.ok else None
    for w in workers or []:
        role = {"prefill": "prefill", "decode": "decode"}.get(w.worker_type, "unified")
        routes.append(Route(w.url.rstrip("/"), role))
    known = {origin(r.url) for r in routes}
    for url in ctx.workers:
        if origin(url) not in known:
            routes.append(Route(url.rstrip("/"), "unified"))
    return routes


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
        ref = probe.reference(giver, pa)
        if ref is None:
            return None
        own_a, own_b = probe.own(giver, pa, "a"), probe.own(giver, pb, "b")
        if own_a is None or own_b is None:
            return None
        if own_a != own_b:
            return Pair(pa, pb, own_a, own_b, ref)
    return None
