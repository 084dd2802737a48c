"""Expired transfer leases on honest traffic: decode must never answer from blocks reused since.

A prefill node holds a request's KV blocks for decode to read only for a lease (vLLM's
NixlConnector: `kv_lease_duration`, extended by decode's heartbeats); when it runs out
the blocks are free, and nothing on either side checks a later read. The probe builds
that window through the public URL, with honest requests only:

1. X, a long decode, holds part of the decode node's pool, so the next request waits.
2. Tenant A's prompt is prefilled and its reference handed to decode, where it waits
   behind X while its lease runs out.
3. Tenant B's prompt shares A's first full blocks (a common system prompt) and ends in
   the same token, with a different last block: prefill serves B's prefix from its cache
   and writes B's last block into the one A's lease freed.

When decode then reads A's blocks it reads B's KV, and A's answer is B's own
continuation (the two race to prefill, so the roles can swap: either way counts).
Each continuation is measured first on the quiet fleet, so whose KV
answered is shown by construction: a FAIL needs A's answer to equal B's and differ
from A's own. The window only opens where one request at the input limit fills both
pools and the lease is shorter than decode's wait; the leases that ran out are read
from the prefill node's `vllm:nixl_num_kv_expired_reqs`. Without a foreign answer the
verdict is inconclusive, never PASS: it proves a leak, never its absence.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvfence.audit.base import CheckResult, Verdict
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.targets.base import Endpoints, NodeFacts, Target, samples_named
from kvfence.audit.targets.registry import detect

ANSWER_TOKENS = 16
TRIALS = 5  # the first leak ends the probe; each trial waits out the long decode
EXPIRED = "vllm:nixl_num_kv_expired_reqs"
RUNNING = "vllm:num_requests_running"
# Token ids drawn from here exist in any vocabulary of 512 or more and avoid the low ids
# where byte-level vocabularies keep control bytes and special tokens.
TOKEN_RANGE = (100, 500)


@dataclass(frozen=True, slots=True)
class Pair:
    """A's and B's prompts: equal length, the same full blocks and last token."""

    a: list[int]
    b: list[int]
    shared_tokens: int


@dataclass(frozen=True, slots=True)
class Trial:
    """One trial: each prompt's quiet continuation and its answer under load."""

    own_a: str
    own_b: str
    answer_a: str | None
    answer_b: str | None
    statuses: tuple[int | None, int | None]
    expired: int | None  # leases prefill let run out during the trial

    @property
    def victim(self) -> str | None:
        """Whose answer came from the other's KV. The two race to prefill, so either can
        be the one decode holds past its lease while the other reuses its block."""
        if self.answer_a == self.own_b != self.own_a:
            return "A"
        if self.answer_b == self.own_a != self.own_b:
            return "B"
        return None

    @property
    def own(self) -> bool:
        return self.answer_a == self.own_a and self.answer_b == self.own_b

    def to_json(self) -> dict[str, Any]:
        return {
            "own_continuation_a": self.own_a,
            "own_continuation_b": self.own_b,
            "a_answer_under_load": self.answer_a,
            "b_answer_under_load": self.answer_b,
            "statuses": list(self.statuses),
            "leases_expired": self.expired,
            "verdict": f"leak: {self.victim} answered from the other's KV"
            if self.victim
            else ("own" if self.own else "differs"),
        }


def make_pair(rng: Any, length: int, block: int) -> Pair:
    """Prompts of `length` tokens sharing every full block but the last, and the last token."""
    shared = (length - 1) // block * block
    prefix, last = _draw(rng, shared), _draw(rng, 1)
    tail = length - shared - 1
    return Pair(prefix + _draw(rng, tail) + last, prefix + _draw(rng, tail) + last, shared)


def _draw(rng: Any, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


class LeaseReuseCheck(Check):
    name = "lease_reuse"
    description = (
        "decode never answers an honest request from blocks reused after its lease ran out"
    )

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        """quiet answers -> X holds decode -> A waits past its lease -> B reuses A's block."""
        a, b = ctx.client(target, "a"), ctx.client(target, "b")
        facts = target.facts(a)
        target.configure_client(b)
        limit = facts.input_limit(ctx.context_override).as_int()
        context = facts.context_length.as_int()
        prefill = [n for n in facts.nodes if n.role.value == "prefill"]
        decode = [n for n in facts.nodes if n.role.value == "decode"]
        if limit is None or context is None or not prefill or not decode:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                "needs the input limit, the context length and a router that lists its prefill "
                "and decode nodes",
            )
        block = _block_size(ctx, prefill[0])
        if block is None:
            return self.result(target, Verdict.INCONCLUSIVE, "the prefill node's block size")
        length = min(limit, context - ANSWER_TOKENS)
        trials: list[Trial] = []
        skipped: list[str] = []
        for i in range(TRIALS):
            ctx.progress("lease_reuse", i / TRIALS)
            trial = self._trial(ctx, (a, b), (prefill, decode), (length, block, context), skipped)
            if trial is None:
                continue
            trials.append(trial)
            if trial.victim:
                break
        return self._verdict(target, trials, skipped, length, block)

    def _trial(
        self,
        ctx: AuditContext,
        clients: tuple[ProbeClient, ProbeClient],
        nodes: tuple[list[NodeFacts], list[NodeFacts]],
        shape: tuple[int, int, int],
        skipped: list[str],
    ) -> Trial | None:
        a, b = clients
        length, block, context = shape
        pair = make_pair(ctx.rng, length, block)
        own_a = _text(a.completion(pair.a, max_tokens=ANSWER_TOKENS))
        own_b = _text(b.completion(pair.b, max_tokens=ANSWER_TOKENS))
        if own_a is None or own_b is None or own_a == own_b:
            skipped.append(
                "no quiet answer" if own_a is None or own_b is None else "equal continuations"
            )
            return None  # the pair cannot tell whose KV answered
        # X holds a block of decode's pool for half a context of answer (vLLM's ignore_eos:
        # it cannot end early): A, needing every block, waits there that long, many leases.
        x = _draw(ctx.rng, block)
        expired0 = _expired(ctx, nodes[0])
        with ThreadPoolExecutor(max_workers=3) as pool:
            fx = pool.submit(b.completion, x, max_tokens=context // 2, extra={"ignore_eos": True})
            if not _running(ctx, nodes[1], fx):
                skipped.append("the long decode ended before it was seen running on decode")
                return None
            fa = pool.submit(a.completion, pair.a, max_tokens=ANSWER_TOKENS)
            rb = pool.submit(b.completion, pair.b, max_tokens=ANSWER_TOKENS).result()
            ra = fa.result()
            fx.result()
        expired1 = _expired(ctx, nodes[0])
        moved = None if expired0 is None or expired1 is None else expired1 - expired0
        return Trial(own_a, own_b, _text(ra), _text(rb), (ra.status, rb.status), moved)

    def _verdict(
        self, target: Target, trials: list[Trial], skipped: list[str], length: int, block: int
    ) -> CheckResult:
        evidence: dict[str, Any] = {
            "prompt_tokens": length,
            "shared_full_blocks": (length - 1) // block,
            "block_size": block,
            "trials": [t.to_json() for t in trials],
            "trials_skipped": skipped,
        }
        leaked = [t for t in trials if t.victim]
        if leaked:
            t = leaked[0]
            victim, other = (t.victim, "B" if t.victim == "A" else "A")
            got = t.answer_a if victim == "A" else t.answer_b
            own = t.own_a if victim == "A" else t.own_b
            return self.result(
                target,
                Verdict.FAIL,
                f"an honest request through the router was answered from another tenant's KV: "
                f"{victim}'s answer is {other}'s own continuation ({got!r}), not its own "
                f"({own!r}); {t.expired} lease(s) ran out on prefill while decode waited, and "
                f"{other}'s prefill reused {victim}'s freed block",
                evidence,
            )
        late = sum(t.expired or 0 for t in trials)
        # No PASS: whether the other prefill took the freed block before decode's late read
        # is an ordering the probe cannot see from outside, so own answers prove nothing.
        return self.result(
            target,
            Verdict.INCONCLUSIVE,
            f"no answer from another request's KV in {len(trials)} trial(s); {late} lease(s) "
            f"ran out on prefill ({EXPIRED}), but a block reused before decode's late read "
            "is not observable here: the probe can prove a leak, never its absence",
            evidence,
        )


def _text(r: Any) -> str | None:
    return r.texts[0] if r.ok and r.texts else None


def _block_size(ctx: AuditContext, node: NodeFacts) -> int | None:
    client = ctx.client_for_url(node.endpoint or node.url, "a")
    return detect(node.endpoint or node.url, client).facts(client).page_size.as_int()


def _metric(ctx: AuditContext, node: NodeFacts, name: str) -> int | None:
    samples = Endpoints(ctx.client_for_url(node.endpoint or node.url, "a")).metrics()
    found = samples_named(samples or [], name)
    return int(sum(s.value for s in found)) if found else None


def _expired(ctx: AuditContext, prefill: list[NodeFacts]) -> int | None:
    counts = [_metric(ctx, n, EXPIRED + "_total") for n in prefill]
    return None if None in counts else sum(c for c in counts if c is not None)


def _running(ctx: AuditContext, decode: list[NodeFacts], fx: Future[Any]) -> bool:
    """Wait until X runs on a decode node (it holds decode's pool); False if X ended first."""
    while not fx.done():
        if any((_metric(ctx, n, RUNNING) or 0) >= 1 for n in decode):
            return True
        time.sleep(0.1)
    return False
