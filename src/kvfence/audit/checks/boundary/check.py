"""Runbook signal 2's sharp edge: probe exactly at the limit, at limit + 1, and in the pool gap.

Rungs (token-exact prompts, see `audit.prompts`):
- control (short) and **at limit** (the longest accepted prompt, max_tokens 1):
  must answer 2xx with content that belongs to the request — non-empty
  output, `usage.prompt_tokens` equal to what was sent, and on kvfence's
  mirror model an echo of the request's own prompt;
- **limit + 1** and **context + 1**: must get an error status AND an error
  body, never a 2xx (assert on the body, not only the status: an abort
  reported as `finish_reason: length` with 200 is SGLang #33507, I6);
- when the pool is smaller than the limit: **just inside the pool** (prompt +
  max_tokens = pool: must succeed with its own content) and **just outside**
  (pool + 1: a 2xx here is content the pool could not have held — the
  Workers AI incident).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfence.audit.base import CheckResult, Plot, PlotSeries, Verdict, worst
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.prompts import Prompt, PromptMaker
from kvfence.audit.targets.base import Target, TargetFacts

ECHO_TOKENS = 8  # output length for in-pool rungs: long enough to see a foreign read
MOST_KEY = "max_input_most"  # TargetFacts.extra: the longest limit any rank / node applies


@dataclass(frozen=True, slots=True)
class Rung:
    name: str
    tokens: int
    max_tokens: int
    expect: str  # "accept" | "reject"
    why: str = "over the advertised limit"


def is_mirror(facts: TargetFacts) -> bool:
    """kvfence's diagnostic mirror model echoes its own prompt: content is checkable exactly."""
    return isinstance(facts.model.value, str) and "mirror" in facts.model.value.lower()


def echoes(r: ProbeResponse, prompt: Prompt) -> bool:
    """The answer replays the prompt's own beginning (kvfence's mirror model does exactly this)."""
    out = r.text.strip()
    return len(out) >= 4 and bool(prompt.text) and prompt.text.lstrip().startswith(out)


def has_content(r: ProbeResponse) -> bool:
    return bool(r.text.strip()) or (r.completion_tokens or 0) > 0


def judge_accept(r: ProbeResponse, prompt: Prompt, mirror: bool) -> tuple[Verdict, str]:
    """An in-limit probe: 2xx with content that belongs to it."""
    if not r.answered:
        return Verdict.INCONCLUSIVE, f"no HTTP answer: {r.error}"
    if not r.ok:
        return (
            Verdict.INCONCLUSIVE,
            f"in-limit prompt rejected ({r.outcome()}): "
            "the engine's declared limit is not the one it enforces",
        )
    if not has_content(r):
        return Verdict.FAIL, f"{r.status} without content (finish_reason={r.finish_reason})"
    if prompt.exact and r.prompt_tokens is not None and r.prompt_tokens != prompt.tokens:
        return (
            Verdict.FAIL,
            f"usage.prompt_tokens={r.prompt_tokens} but {prompt.tokens} tokens were sent",
        )
    if mirror and prompt.text and r.text.strip() and r.text.strip() not in prompt.text:
        return (
            Verdict.FAIL,
            f'mirror model answered "{r.text[:120]}", which is not in the request\'s own prompt: '
            "it read KV the request did not write",
        )
    return Verdict.PASS, f"{r.status} with its own content"


def judge_reject(r: ProbeResponse, why: str = "over the advertised limit") -> tuple[Verdict, str]:
    """An over-long probe: error status AND error body; never 2xx."""
    if not r.answered:
        return Verdict.INCONCLUSIVE, f"no HTTP answer: {r.error}"
    if r.ok:
        what = "with content" if has_content(r) else "without content"
        return (
            Verdict.FAIL,
            f"prompt {why} answered {r.status} {what} (finish_reason={r.finish_reason}, "
            f'text "{r.text[:120]}") — a rejected request must never answer success',
        )
    if not r.body.strip():
        return Verdict.FAIL, f"{r.status} with an empty body: the original error was lost"
    if r.status is not None and r.status >= 500:
        return Verdict.PASS, f"{r.status} with an error body (a 4xx would say it is the client's)"
    return Verdict.PASS, f"{r.status}: {(r.error_message or r.body)[:160]}"


class BoundaryCheck(Check):
    name = "boundary"
    description = "token-exact prompts at the limit, limit + 1 and in the pool < context window"

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client = ctx.client(target, "b")
        facts = target.facts(client)
        limit = facts.input_limit(ctx.context_override)
        evidence: dict[str, Any] = {
            "limit": limit.to_json(),
            "pool_tokens": facts.pool_tokens.to_json(),
        }
        lim = limit.as_int()
        if lim is None:
            return self.result(
                target, Verdict.INCONCLUSIVE, f"input limit unknown ({limit.source})", evidence
            )
        most = facts.extra.get(MOST_KEY) if ctx.context_override is None else None
        if most is not None:
            evidence["limit_most"] = most.to_json()
        rungs = ladder(lim, facts, most.as_int() if most is not None else None)
        maker = PromptMaker(client, ctx.rng, use_tokenize=facts.tokenizer.value == "/tokenize")
        verdicts, rows, mirror = self._climb(ctx, client, maker, rungs, is_mirror(facts))
        evidence["rungs"] = rows
        evidence["echo_model"] = mirror
        verdict = worst(verdicts)
        bad = [r for r in rows if r["verdict"] != Verdict.PASS.value]
        summary = (
            f"{len(rows)} rungs around limit {lim:,}: all answered correctly"
            if not bad
            else "; ".join(f"{r['rung']} ({r['tokens']} tok): {r['detail']}" for r in bad)
        )
        plot = ladder_plot(rows, f"limit {lim} from {limit.source}")
        return self.result(target, verdict, summary, evidence, [plot])

    def _climb(
        self,
        ctx: AuditContext,
        client: ProbeClient,
        maker: PromptMaker,
        rungs: list[Rung],
        mirror: bool,
    ) -> tuple[list[Verdict], list[dict[str, Any]], bool]:
        """Every rung in order: (verdicts, rows, whether the server echoes its prompt)."""
        rows: list[dict[str, Any]] = []
        verdicts: list[Verdict] = []
        for i, rung in enumerate(rungs):
            ctx.progress(f"boundary {rung.name} ({rung.tokens} tokens)", i / len(rungs))
            verdict, row = self._probe(client, maker, rung, mirror)
            if rung.name == "control" and row.pop("echo", False):
                # Learned from the server's behaviour, not its name: later rungs must echo too.
                mirror = True
            verdicts.append(verdict)
            rows.append(row)
        return verdicts, rows, mirror

    def _probe(
        self, client: ProbeClient, maker: PromptMaker, rung: Rung, mirror: bool
    ) -> tuple[Verdict, dict[str, Any]]:
        prompt = maker.make(rung.tokens)
        row: dict[str, Any] = {
            "rung": rung.name,
            "tokens": rung.tokens,
            "max_tokens": rung.max_tokens,
            "expect": rung.expect,
            "status": None,
        }
        if prompt is None:
            row.update(verdict=Verdict.INCONCLUSIVE.value, detail="could not build the prompt")
            return Verdict.INCONCLUSIVE, row
        row["tokens"] = prompt.tokens
        row["exact"] = prompt.exact
        r = client.completion(prompt.payload, max_tokens=rung.max_tokens)
        if rung.expect == "accept":
            verdict, detail = judge_accept(r, prompt, mirror)
        else:
            verdict, detail = judge_reject(r, rung.why)
        row.update(status=r.status, verdict=verdict.value, detail=detail, response=r.brief())
        if r.ok and echoes(r, prompt):
            row["echo"] = True
        return verdict, row


def ladder(limit: int, facts: TargetFacts, most: int | None = None) -> list[Rung]:
    """The rungs for an input limit (longest prompt accepted with max_tokens=1) and the pool.

    `most`: where ranks or nodes apply different limits (SGLang DP ranks, a
    fleet's prefill nodes), the longest any of them accepts. "at limit" must
    pass everywhere (the smallest limit) and the reject rung must be rejected
    everywhere, so it sits above the largest — a prompt between the two may
    land on a node that legitimately takes it.
    """
    over = max(limit, most or limit) + 1
    rungs = [
        Rung("control", min(64, max(1, limit // 4)), ECHO_TOKENS, "accept"),
        Rung("at limit", limit, 1, "accept"),
        Rung("limit + 1" if over == limit + 1 else "above every limit", over, 1, "reject"),
    ]
    context = facts.context_length.as_int()
    if context is not None and context + 1 > over:
        rungs.append(Rung("context + 1", context + 1, 1, "reject"))
    pool = facts.pool_tokens.as_int()
    if pool is not None and pool < limit:
        # The incident's window: accepted by the edge, larger than the pool.
        rungs.insert(2, Rung("inside pool", pool - ECHO_TOKENS, ECHO_TOKENS, "accept"))
        rungs.insert(
            3,
            Rung(
                "pool + 1",
                pool + 1,
                ECHO_TOKENS * 2,
                "reject",
                f"larger than the {pool:,}-token KV pool",
            ),
        )
        # A prompt the pool cannot hold has no honest 2xx, whatever the edge advertises.
        why = f"larger than the {pool:,}-token KV pool"
        rungs = [
            Rung(r.name, r.tokens, r.max_tokens, "reject", why)
            if r.tokens + r.max_tokens > pool and r.expect == "accept"
            else r
            for r in rungs
        ]
    return rungs


def ladder_plot(rows: list[dict[str, Any]], note: str) -> Plot:
    return Plot(
        kind="ladder",
        title="Boundary ladder: HTTP status by prompt length",
        x_label="prompt tokens",
        y_label="HTTP status",
        series=[
            PlotSeries(
                name="rungs",
                x=[float(r["tokens"]) for r in rows],
                y=[float(r["status"] or 0) for r in rows],
                labels=[f"{r['rung']} ({r['expect']})" for r in rows],
                flags=[r["verdict"] != Verdict.PASS.value for r in rows],
            )
        ],
        note=note,
    )
