"""Runbook signal 2: tenant A's unique sentinels must never reach tenant B.

Tenant A sends prompts dense with a fresh random sentinel at several lengths
(short, half the limit, and at the pool/limit boundary). Tenant B sends
unrelated prompts — in-limit and over-long (limit + 1, pool + 1) — first
strictly after each A request (sequential: A's pages are free and reusable),
then concurrently with A (interleaved). Every byte B gets back — body, every
stream chunk, every choice, error messages — is searched for each sentinel
verbatim and for every run of >= 4 of its tokens. One hit fails the audit
with the exact (A, B) request pair as evidence.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.base import CheckResult, Verdict
from kvfence.audit.checks.canary.probe_length import OverLong, TokenCounter, over_bound
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.prompts import Prompt, PromptMaker, make_sentinel, random_words
from kvfence.audit.targets.base import Target, TargetFacts

MIN_FRAGMENT_TOKENS = 4
SENTINEL_PREFIX = "KVF-"  # shared by every sentinel (see prompts.make_sentinel)
B_MAX_TOKENS = 32  # long enough for B's output to walk past its own first page
A_MAX_TOKENS = 8


@dataclass(slots=True)
class Planted:
    sentinel: str
    fragments: list[str]  # texts of every >= 4-token run of the sentinel
    prompt_tokens: int
    response: ProbeResponse | None = None


@dataclass(slots=True)
class Observed:
    label: str
    response: ProbeResponse
    after: list[int] = field(default_factory=list)  # indices of A requests done before it


def _unique(fragment: str) -> bool:
    """A fragment must carry part of the random groups and a letter.

    The shared 'KVF-' prefix proves nothing, and neither do digits alone: a
    group can come out all digits (KVF-4821-...), and tokenizers that split
    numbers digit by digit make it four tokens that any id or count in an
    engine's body can contain by chance.
    """
    return (
        len(fragment) >= MIN_FRAGMENT_TOKENS
        and fragment not in SENTINEL_PREFIX
        and any(c.isalpha() for c in fragment)
    )


def fragments_from_pieces(pieces: list[str], n: int = MIN_FRAGMENT_TOKENS) -> list[str]:
    """Texts of every contiguous run of >= n tokens (given each token's text), longest first."""
    out = {
        "".join(pieces[i:j]).strip()
        for i in range(len(pieces))
        for j in range(i + n, len(pieces) + 1)
    }
    return sorted((f for f in out if _unique(f)), key=len, reverse=True)


def fragments_from_chars(sentinel: str, width: int = 8) -> list[str]:
    """Without a tokenizer: every substring of `width`+ characters (about 4 tokens)."""
    return sorted(
        {
            f
            for i in range(len(sentinel))
            for j in range(i + width, len(sentinel) + 1)
            if _unique(f := sentinel[i:j])
        },
        key=len,
        reverse=True,
    )


def find_leak(text: str, planted: Planted) -> str | None:
    """The longest sentinel fragment present in `text` (verbatim sentinel first), or None."""
    if planted.sentinel in text:
        return planted.sentinel
    for frag in planted.fragments:
        if frag in text:
            return frag
    return None


def excerpt(text: str, needle: str, width: int = 80) -> str:
    i = text.find(needle)
    return text[max(0, i - width) : i + len(needle) + width]


class CanaryCheck(Check):
    name = "canary"
    description = (
        "tenant A's sentinels never appear in tenant B's responses (verbatim or fragments)"
    )

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        """plant A's sentinels -> B probes after each A request -> B probes alongside A -> search."""
        a = ctx.client(target, "a")
        b = ctx.client(target, "b")
        facts = target.facts(a)
        target.configure_client(b)
        limit = facts.input_limit(ctx.context_override).as_int()
        if limit is None:
            return self.result(target, Verdict.INCONCLUSIVE, "input limit unknown")
        tokenize = facts.tokenizer.value == "/tokenize"
        a_lengths, b_lengths = plan_lengths(limit, facts)
        plan = _Plan(b_lengths)
        maker_a = PromptMaker(a, ctx.rng, use_tokenize=tokenize)
        for n in a_lengths:
            sentinel = make_sentinel(ctx.rng)
            pa = maker_a.make(n, head=sentinel, repeat_head=True)
            if pa is None:
                return self.result(target, Verdict.INCONCLUSIVE, "could not build A's prompts")
            plan.planted.append(Planted(sentinel, self._fragments(maker_a, sentinel), pa.tokens))
            plan.a_prompts.append(pa)
        maker_b = PromptMaker(b, ctx.rng, use_tokenize=tokenize)
        if not plan.make_b(ctx, maker_b, facts):
            return self.result(target, Verdict.INCONCLUSIVE, "could not build B's prompts")
        observed = plan.sequential(ctx, a, b)
        a_interleaved = plan.interleaved(ctx, a, b, observed)
        return self._verdict(target, plan.planted, a_interleaved, observed, plan.probes)

    @staticmethod
    def _fragments(maker: PromptMaker, sentinel: str) -> list[str]:
        if maker.use_tokenize:
            ids = maker.content_ids(" " + sentinel)
            if ids:
                pieces = [maker.client.detokenize([t]) for t in ids]
                if all(p is not None for p in pieces):
                    return fragments_from_pieces([p for p in pieces if p is not None])
        return fragments_from_chars(sentinel)

    def _verdict(
        self,
        target: Target,
        planted: list[Planted],
        a_interleaved: list[ProbeResponse],
        observed: list[Observed],
        probes: list[OverLong],
    ) -> CheckResult:
        hits = find_hits(planted, observed)
        evidence = _evidence(planted, a_interleaved, observed, hits)
        evidence["over_long_probes"] = _probes_json(probes, observed)
        a_ok, b_answered = evidence["a_requests_ok"], evidence["b_answered"]
        if hits:
            first = hits[0]
            return self.result(
                target,
                Verdict.FAIL,
                f"tenant A's sentinel {first['tenant_a_request']['sentinel']} reached tenant B "
                f"({len(hits)} hits; first in '{first['tenant_b_request']['label']}', "
                f'status {first["tenant_b_request"]["status"]}, matched "{first["matched"]}")',
                evidence,
            )
        if a_ok == 0:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                "no tenant-A request succeeded: no sentinel was planted",
                evidence,
            )
        if b_answered < len(observed):
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"{len(observed) - b_answered} tenant-B requests got no HTTP answer",
                evidence,
            )
        return self.result(
            target,
            Verdict.PASS,
            f"{len(planted)} sentinels, {a_ok} A requests, {len(observed)} B requests "
            "(sequential and interleaved, incl. over-long): no sentinel or 4-token fragment in B"
            + _unverified_note(probes),
            evidence,
        )


@dataclass(slots=True)
class _Plan:
    """A's sentinel prompts and B's probes, and the two phases that send them."""

    b_lengths: list[tuple[int, str]]
    planted: list[Planted] = field(default_factory=list)
    a_prompts: list[Prompt] = field(default_factory=list)
    b_prompts: list[Prompt] = field(default_factory=list)
    probes: list[OverLong] = field(default_factory=list)  # the over-long ones, measured
    done: int = 0

    @property
    def total(self) -> int:
        return len(self.a_prompts) * (1 + len(self.b_prompts)) * 2

    def make_b(self, ctx: AuditContext, maker: PromptMaker, facts: TargetFacts) -> bool:
        """B's prompts; each over-long one grown until its measured length is over its bound."""
        counter = TokenCounter(maker.client, facts)
        try:
            for n, label in self.b_lengths:
                p = maker.make(n, head=random_words(ctx.rng, 6))
                if p is None:
                    return False
                if label.startswith("over"):  # "pool + 1" / "limit + 1": the bound is n - 1
                    self.probes.append(over_bound(maker, counter, label, p, n - 1))
                    p = self.probes[-1].prompt
                self.b_prompts.append(p)
        finally:
            counter.close()
        return True

    def sequential(self, ctx: AuditContext, a: ProbeClient, b: ProbeClient) -> list[Observed]:
        """Each A request completes, then B probes the freed pages — over-long probes first,
        while the pages still hold A's KV (a short B request would reuse them first: seen
        through sglang-router, where it hid the leak of the over-pool probe)."""
        observed: list[Observed] = []
        probes = sorted(
            zip(self.b_lengths, self.b_prompts, strict=True),
            key=lambda lp: not lp[0][1].startswith("over"),
        )
        for i, (pa, pl) in enumerate(zip(self.a_prompts, self.planted, strict=True)):
            pl.response = a.completion(pa.payload, max_tokens=A_MAX_TOKENS)
            for (_, label), pb in probes:
                stream = label.startswith("over") and i % 2 == 1
                r = b.completion(pb.payload, max_tokens=B_MAX_TOKENS, stream=stream)
                observed.append(
                    Observed(f"sequential after A#{i}: B {label}", r, list(range(i + 1)))
                )
                self.done += 1
                ctx.progress("canary (sequential)", self.done / self.total)
        return observed

    def interleaved(
        self, ctx: AuditContext, a: ProbeClient, b: ProbeClient, observed: list[Observed]
    ) -> list[ProbeResponse]:
        """A and B at once; B's answers join `observed`; A's responses are returned."""
        n_a = len(self.a_prompts)
        with ThreadPoolExecutor(max_workers=4) as pool:
            futs_a = [
                pool.submit(a.completion, pa.payload, max_tokens=A_MAX_TOKENS, stream=True)
                for pa in self.a_prompts
            ]
            futs_b = [
                (label, pool.submit(b.completion, pb.payload, max_tokens=B_MAX_TOKENS))
                for (_, label), pb in zip(self.b_lengths, self.b_prompts, strict=True)
                for _ in range(n_a)
            ]
            for label, fb in futs_b:
                observed.append(Observed(f"interleaved: B {label}", fb.result(), list(range(n_a))))
                self.done += 1
                ctx.progress("canary (interleaved)", self.done / self.total)
            return [f.result() for f in futs_a]


def find_hits(planted: list[Planted], observed: list[Observed]) -> list[dict[str, Any]]:
    """Every (A sentinel, B response) pair where B's bytes carry the sentinel or a fragment."""
    hits: list[dict[str, Any]] = []
    for ob in observed:
        text = ob.response.searchable()
        for idx, pl in enumerate(planted):
            frag = find_leak(text, pl)
            if frag is not None:
                hits.append(
                    {
                        "tenant_a_request": {
                            "index": idx,
                            "sentinel": pl.sentinel,
                            "prompt_tokens": pl.prompt_tokens,
                            "response": pl.response.brief() if pl.response else None,
                        },
                        "tenant_b_request": {"label": ob.label, **ob.response.brief()},
                        "matched": frag,
                        "matched_tokens_at_least": MIN_FRAGMENT_TOKENS,
                        "context": excerpt(text, frag),
                    }
                )
    return hits


def _probes_json(probes: list[OverLong], observed: list[Observed]) -> list[Any]:
    """Each over-long probe's measured length, with the engine's count where it answered 200."""
    return [
        pr.to_json([o.response for o in observed if o.label.endswith(pr.label)]) for pr in probes
    ]


def _unverified_note(probes: list[OverLong]) -> str:
    unverified = [f"{pr.label}: {pr.tokens} tokens" for pr in probes if not pr.verified]
    return f"; not verified over their bound: {', '.join(unverified)}" if unverified else ""


def _evidence(
    planted: list[Planted],
    a_interleaved: list[ProbeResponse],
    observed: list[Observed],
    hits: list[dict[str, Any]],
) -> dict[str, Any]:
    a_ok = sum(1 for p in planted if p.response is not None and p.response.ok)
    a_ok += sum(1 for r in a_interleaved if r.ok)
    return {
        "sentinels": [p.sentinel for p in planted],
        "a_prompt_tokens": [p.prompt_tokens for p in planted],
        "a_requests_ok": a_ok,
        "a_statuses": [p.response.status if p.response else None for p in planted]
        + [r.status for r in a_interleaved],
        "b_requests": len(observed),
        "b_answered": sum(1 for o in observed if o.response.answered),
        "b_statuses": sorted({str(o.response.status) for o in observed}),
        "fragments_per_sentinel": [len(p.fragments) for p in planted],
        "hits": hits[:20],
        "hit_count": len(hits),
    }


def plan_lengths(limit: int, facts: TargetFacts) -> tuple[list[int], list[tuple[int, str]]]:
    """(A's prompt lengths, B's (length, label)) for an input limit and pool."""
    pool = facts.pool_tokens.as_int()
    # `limit` is the longest prompt with max_tokens=1; A asks for A_MAX_TOKENS.
    top = limit + 1 - A_MAX_TOKENS
    if pool is not None:
        top = min(top, pool - A_MAX_TOKENS)
    top = max(top, 16)
    a = sorted({min(64, top), max(16, top // 2), top})
    b: list[tuple[int, str]] = [(min(48, limit), "short")]
    if pool is not None and pool < limit:
        b.append((pool + 1, "over-pool (pool + 1)"))
    b.append((limit + 1, "over-limit (limit + 1)"))
    return a, b
