"""What the transfer-reference probes share: routes, prompts that tell whose KV, outcomes.

Both probes (vLLM's `kv_transfer_params`, transfer_reference.py; SGLang's bootstrap
fields, bootstrap.py) prove whose KV decode read by construction: tenant A's
and tenant B's prompts have equal length and the same last tokens, and their greedy
continuations, computed beforehand under fresh cache salts, differ. B's answer equal to
A's continuation is A's KV; B's own is B's; anything else is KV that is not B's.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from kvfence.audit.base import JSONValue
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.contract import AuditContext
from kvfence.audit.fleet import origin, parse_workers
from kvfence.audit.prompts import random_words
from kvfence.audit.targets.base import Target

MAX_TOKENS = 8  # the greedy continuation that tells whose KV was read
MIN_AGREED = 4  # leading characters an answer must share with another prompt's continuation
TOKEN_RANGE = (10, 250)  # byte-level ids every byte-level BPE vocabulary holds

Prompt = str | list[int]  # token ids, or their text where a route takes text only


@dataclass(frozen=True, slots=True)
class Route:
    url: str  # full URL used to reach it (may carry a router credential in its path)
    role: str  # public | prefill | decode | unified
    bootstrap_port: int | None = None  # a prefill worker's bootstrap port, as the router lists it

    @property
    def shown(self) -> str:
        return f"{self.role} {origin(self.url)}"


@dataclass(slots=True)
class Outcome:
    route: str
    case: str  # live | reused | poisoned | bootstrap-live | bootstrap-reused
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
    slowest_s: float = 0.0  # the slowest own continuation seen: paces the waits on a route
    last_error: str = ""  # why the last own continuation could not be had

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
                self._first(url)
                return ids[:head] + tail
        lo, hi = TOKEN_RANGE
        return [self.ctx.rng.randrange(lo, hi) for _ in range(head)] + tail

    def _first(self, url: str) -> None:
        """Ask the route that answered first from now on (each miss costs a request)."""
        self.tokenizers = (url, *(u for u in self.tokenizers if u != url))

    def text(self, ids: list[int]) -> str | None:
        """The text that tokenizes back to exactly `ids` (for text-only routers), or None."""
        for url in self.tokenizers:
            client = self.client(url, "a")
            text = client.detokenize(ids)
            if text is not None:
                return text if client.tokenize(text) == ids else None
        return None

    def own(self, route: Route, prompt: Prompt, tenant: str) -> str | None:
        """The prompt's greedy continuation with nothing cached (a fresh cache salt)."""
        salt = {"cache_salt": f"kvfence-audit-{secrets.token_hex(8)}"}
        r = self.client(route.url, tenant).completion(prompt, max_tokens=MAX_TOKENS, extra=salt)
        if r.status in (400, 422):  # no cache_salt on this engine: the plain answer
            r = self.client(route.url, tenant).completion(prompt, max_tokens=MAX_TOKENS)
        self.slowest_s = max(self.slowest_s, r.total_s)
        if r.ok and r.texts:
            return r.texts[0]
        self.last_error = f"{route.shown} answered {r.status or r.error}: {_message(r)[:120]}"
        return None


def classify(route: str, case: str, r: ProbeResponse, whose: dict[str, str]) -> Outcome:
    """What B's answer proves: whose continuation it is (`whose`: label → text; "B" is B's own)."""
    if r.status is None:
        return Outcome(route, case, None, "error", f"no answer: {r.error}")
    if 400 <= r.status < 500:
        return Outcome(route, case, r.status, "refused", f"refused: {_message(r)}")
    if r.status >= 500 or not r.texts:
        return Outcome(route, case, r.status, "error", f"server error: {r.body[:160]}")
    out = _classify_text(route, case, r.texts[0], whose)
    out.expected = dict(whose)
    return out


def _shared(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _message(r: ProbeResponse) -> str:
    """The refusal's own words (OpenAI's error envelope, else the body's start)."""
    err = r.json.get("error") if isinstance(r.json, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])[:200]
    return r.body[:200]


def _classify_text(route: str, case: str, text: str, whose: dict[str, str]) -> Outcome:
    for label, own in whose.items():
        if text == own:
            if label == "B":
                return Outcome(route, case, 200, "own", "answered from B's own KV", text)
            return Outcome(route, case, 200, "leak", f"answered with {label}'s continuation", text)
    # Greedy decoding over the same KV through another kernel path (decode attending over
    # transferred pages, prefill over its own) can break a near-tie the other way and then
    # drift. An answer that follows another prompt's continuation past the point where that
    # continuation and B's part was steered by that prompt's KV: the same finding, named.
    theirs = {label: _shared(text, own) for label, own in whose.items() if label != "B"}
    mine = _shared(text, whose.get("B", ""))
    if theirs:
        label, agreed = max(theirs.items(), key=lambda kv: kv[1])
        if agreed > mine and agreed >= MIN_AGREED:
            return Outcome(
                route,
                case,
                200,
                "leak",
                f"answered with {label}'s continuation for its first {agreed} characters "
                f"(B's own shares {mine}), then drifted",
                text,
            )
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


def routes_of(ctx: AuditContext, target: Target, client: ProbeClient) -> list[Route]:
    """The public URL, then every worker the router lists and every `--worker` given."""
    routes = [Route(target.url, "public")]
    listed = client.get("/workers")
    workers = parse_workers(listed.json) if listed.ok else None
    for w in workers or []:
        role = {"prefill": "prefill", "decode": "decode"}.get(w.worker_type, "unified")
        routes.append(Route(w.url.rstrip("/"), role, w.bootstrap_port))
    known = {origin(r.url) for r in routes}
    for url in ctx.workers:
        if origin(url) not in known:
            routes.append(Route(url.rstrip("/"), "unified"))
    return routes
