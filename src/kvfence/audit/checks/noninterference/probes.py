"""What the noninterference check sends: tenant B's fixed probes against their reference
answers (alone, then under load) and tenant A's concurrent load; and how a repeat is
compared with its reference (`Tally`)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.base import JSONValue
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.contract import AuditContext


@dataclass(frozen=True, slots=True)
class NoninterferenceConfig:
    """Probe and load shape.

    ``probes`` distinct B prompts of ``probe_tokens`` tokens, each answered
    ``repeats`` times alone and ``repeats`` times under load;
    ``max_tokens`` generated per answer. With ``long_probe`` the last probe is
    long: just past the KV pool when the target's pool is smaller than its
    input limit (where the Workers AI reject path fired), else at the input
    limit but at most ``long_probe_cap`` tokens. A's load: ``load_concurrency``
    threads sending ``load_tokens``-token prompts (``load_max_tokens`` out).

    A's requests are short, since every B repeat under load waits one of them out
    (`Load`), but each one grows a page while it decodes (60 + 8 tokens at the embedded
    engines' page of 16: four pages reserved for the prompt, a fifth taken at token 64),
    so the number of pages A holds keeps moving. With LIFO page reuse, B's last released
    page stays on top of the free list for as long as A never holds more pages than it
    did when B released it; A requests whose footprint never changes hand the same pages
    round and round above it. Measured on the main job's lab (its long probe reads the
    top page): A requests that never grow a page (40 + 4, 56 + 8) let it read its own
    earlier answer back on 2 to 5 of 10 repeats under load in 7 of 17 runs (a missed
    leak); ones that grow one (30 + 4, 60 + 8, 64 + 16, 192 + 16) diverged on 10 of 10
    in every run (23 runs, load 4-12).
    """

    probes: int = 4
    probe_tokens: int = 48
    max_tokens: int = 8
    repeats: int = 8
    long_probe: bool = True
    long_probe_cap: int = 1024
    logprobs: int = 1
    load_concurrency: int = 3
    load_tokens: int = 60
    load_max_tokens: int = 8
    alpha: float | None = None  # None: the audit's share (AuditContext.alpha_for)
    token_range: tuple[int, int] = (100, 500)

    def __post_init__(self) -> None:
        if min(self.probes, self.probe_tokens, self.max_tokens, self.repeats) < 1:
            raise ValueError("probes, probe_tokens, max_tokens and repeats must be >= 1")
        if self.load_concurrency < 1 or not 0 < (self.alpha or 0.5) < 1:
            raise ValueError("need load_concurrency >= 1 and 0 < alpha < 1")


@dataclass(frozen=True, slots=True)
class Answer:
    """What a temperature-0 answer is compared on."""

    tokens: tuple[Any, ...]  # generated tokens (ids or strings, as the server reports them)
    text: str
    logprobs: tuple[float, ...]

    def same_output(self, other: Answer) -> bool:
        return self.text == other.text and self.tokens == other.tokens

    def max_logprob_delta(self, other: Answer) -> float | None:
        n = min(len(self.logprobs), len(other.logprobs))
        if n == 0 or not self.same_output(other):
            return None
        return max(abs(a - b) for a, b in zip(self.logprobs[:n], other.logprobs[:n], strict=True))


def answer_of(resp: ProbeResponse) -> Answer:
    """Tokens and chosen-token logprobs in the completion or the chat shape."""
    lp = resp.logprobs
    tokens: list[Any] = []
    values: list[float] = []
    if isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
        tokens = list(lp.get("tokens") or [])
        values = [float(v) for v in lp["token_logprobs"] if isinstance(v, int | float)]
    elif isinstance(lp, dict) and isinstance(lp.get("content"), list):
        for item in lp["content"]:
            if isinstance(item, dict):
                tokens.append(item.get("id", item.get("token")))
                v = item.get("logprob")
                if isinstance(v, int | float):
                    values.append(float(v))
    return Answer(tuple(tokens), resp.text, tuple(values))


@dataclass(slots=True)
class Tally:
    """Divergences of one phase (alone or under load)."""

    total: int = 0
    diverged: int = 0
    max_logprob_delta: float = 0.0
    examples: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    per_probe: dict[int, list[int]] = field(default_factory=dict)  # probe -> [answers, diverged]
    stopped_early: str | None = None  # why the planned repeats were not all needed
    rounds: int = 0  # rounds sent (every probe once per round)

    def record(self, probe: int, ref: Answer, resp: ProbeResponse) -> None:
        if not resp.ok:
            self.errors.append(resp.brief())
            return
        got = answer_of(resp)
        self.total += 1
        counts = self.per_probe.setdefault(probe, [0, 0])
        counts[0] += 1
        if not got.same_output(ref):
            self.diverged += 1
            counts[1] += 1
            if len(self.examples) < 3:
                self.examples.append(
                    {
                        "probe": probe,
                        "reference_text": ref.text,
                        "reference_tokens": list(ref.tokens),
                        "got_text": got.text,
                        "got_tokens": list(got.tokens),
                        "response": resp.brief(),
                    }
                )
            return
        delta = got.max_logprob_delta(ref)
        if delta is not None:
            self.max_logprob_delta = max(self.max_logprob_delta, delta)

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "answers": self.total,
            "diverged": self.diverged,
            "rate": self.diverged / self.total if self.total else None,
            "max_logprob_delta": self.max_logprob_delta,
            "per_probe": {
                str(k): {"answers": a, "diverged": d} for k, (a, d) in self.per_probe.items()
            },
            "examples": self.examples,
            "errors": self.errors[:3],
            "error_count": len(self.errors),
            "rounds": self.rounds,
            "stopped_early": self.stopped_early,
        }


class Load:
    """Tenant A's concurrent traffic while B probes; stops when told.

    `running` is set once A has finished as many requests as it has threads (or a
    worker ended): from then on the pool holds A's data and every thread is sending, so
    a B repeat that follows is under load, not racing the load's first request.
    `wait_for_turnover` holds each B repeat until an A request that began after B's
    previous answer has ended: A's traffic took pages, wrote and released them between
    every two B repeats — by construction, not by how the machine's load happens to
    time them (a leak that serves B from recently released memory, like the lab's, then
    shows on every repeat, not on some).
    """

    def __init__(self, client: ProbeClient, cfg: NoninterferenceConfig, rng: random.Random) -> None:
        self.client, self.cfg = client, cfg
        self.seeds = [rng.getrandbits(32) for _ in range(cfg.load_concurrency)]
        self.stop = threading.Event()
        self.running = threading.Event()
        self.lock = threading.Lock()
        self.ended = threading.Condition(self.lock)  # notified whenever an A request ends
        self.sent = 0
        self.ok = 0
        self.failures: list[dict[str, Any]] = []
        self.stopped_workers = 0
        self.waits_timed_out = 0
        self.begun = 0  # A requests sent so far
        self.newest_ended = -1  # the highest begin index among A requests that ended

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        lo, hi = self.cfg.token_range
        try:
            while not self.stop.is_set():
                prompt = [rng.randrange(lo, hi) for _ in range(self.cfg.load_tokens)]
                with self.lock:
                    index, self.begun = self.begun, self.begun + 1
                r = self.client.completion(
                    prompt, max_tokens=self.cfg.load_max_tokens, temperature=1.0
                )
                with self.lock:
                    self.sent += 1
                    if r.ok:
                        self.ok += 1
                    elif len(self.failures) < 3:
                        self.failures.append(r.brief())
                    if self.sent >= self.cfg.load_concurrency:
                        self.running.set()
                    self.newest_ended = max(self.newest_ended, index)
                    self.ended.notify_all()
        finally:
            self.running.set()  # a worker that ended (or crashed) is never waited for
            with self.lock:
                self.stopped_workers += 1
                self.ended.notify_all()

    def mark(self) -> int:
        """How many A requests have begun so far (to wait past with `wait_for_turnover`)."""
        with self.lock:
            return self.begun

    def wait_for_turnover(self, mark: int, timeout_s: float) -> bool:
        """Until an A request begun after `mark` has ended (False: none within `timeout_s`,
        or every worker stopped — the repeat is then sent anyway, counted on record)."""
        with self.lock:
            return (
                self.ended.wait_for(
                    lambda: self.newest_ended >= mark or self.stopped_workers >= len(self.seeds),
                    timeout=timeout_s,
                )
                and self.newest_ended >= mark
            )

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "sent": self.sent,
            "ok": self.ok,
            "failures": self.failures,
            "repeats_without_turnover": self.waits_timed_out,
        }


@dataclass(slots=True)
class Probes:
    """Tenant B's probes: their reference answers, and the phases that repeat them."""

    client: ProbeClient
    cfg: NoninterferenceConfig
    logprobs: int | None
    prompts: list[list[int]] = field(default_factory=list)
    refs: list[Answer] = field(default_factory=list)
    dropped: list[dict[str, JSONValue]] = field(default_factory=list)

    def send(self, prompt: list[int]) -> ProbeResponse:
        return self.client.completion(
            prompt, max_tokens=self.cfg.max_tokens, temperature=0.0, logprobs=self.logprobs
        )

    def first(self, prompt: list[int]) -> ProbeResponse:
        """The first probe alone; it is the first reference when it succeeds."""
        first = self.send(prompt)
        if first.status == 400 and self.logprobs is not None:
            self.logprobs = None  # the target refuses logprobs: compare text and tokens only
            first = self.send(prompt)
        if first.ok:
            self.prompts.append(prompt)
            self.refs.append(answer_of(first))
        return first

    def references(self, prompts: list[list[int]]) -> None:
        # A probe the target refuses (e.g. the long one on an undersized pool that
        # rejects at the edge, I4) has no reference answer: it is dropped, on record.
        for prompt in prompts:
            ref = self.send(prompt)
            if ref.ok:
                self.prompts.append(prompt)
                self.refs.append(answer_of(ref))
            else:
                self.dropped.append({"prompt_tokens": len(prompt), **ref.brief()})

    def tally(
        self,
        ctx: AuditContext,
        phase: str,
        load: Load | None = None,
        stop: Callable[[Tally, int], str | None] | None = None,
    ) -> Tally:
        """Every probe, `repeats` times, against its reference; under `load`, each repeat
        only after an A request ended since B's previous answer (`Load`). After each round,
        `stop(tally, rounds left)` may end the phase, saying why (`curtail.decided`)."""
        tally = Tally()
        ctx.progress(phase, 0.0)
        mark = load.mark() if load is not None else 0
        for rep in range(self.cfg.repeats):
            for i, prompt in enumerate(self.prompts):
                if load is not None and not load.wait_for_turnover(mark, ctx.request_timeout_s):
                    load.waits_timed_out += 1
                tally.record(i, self.refs[i], self.send(prompt))
                mark = load.mark() if load is not None else 0
            tally.rounds = rep + 1
            ctx.progress(phase, (rep + 1) / self.cfg.repeats)
            if stop is not None:
                tally.stopped_early = stop(tally, self.cfg.repeats - rep - 1)
                if tally.stopped_early is not None:
                    break
        return tally

    def under_load(
        self, ctx: AuditContext, load: Load, stop: Callable[[Tally, int], str | None] | None = None
    ) -> Tally:
        with ThreadPoolExecutor(max_workers=self.cfg.load_concurrency) as pool:
            futures = [pool.submit(load.worker, s) for s in load.seeds]
            try:
                load.running.wait(timeout=ctx.request_timeout_s)
                loaded = self.tally(ctx, "noninterference: under load", load, stop)
            finally:
                load.stop.set()
            for f in futures:
                f.result()  # a crashed load worker is a crashed check (fail closed)
        return loaded
