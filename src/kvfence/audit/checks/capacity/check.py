"""Runbook signal 1: the live KV pool must hold the context with headroom (I4).

`pool_tokens >= context × headroom`, with both numbers read from the running
engine (or the context from `--context`). An unknown pool or context is
INCONCLUSIVE — a gate that cannot read the pool must block, not pass.

- A fleet behind a router (`facts.nodes`): every prefill node is gated on its
  own pool; the verdict is the worst, and a failure names the node.
- A decode node alone is never a pass: its pool is not the reject path's.
- A start-up guarantee (`extra["pool_guarantee_tokens"]`, TGI 3.x) stands in
  for an unreported pool only at headroom 1.0 — it promises one request. It is
  a lower bound: it can pass the gate, and below the need it is inconclusive.
- A pool that may be shared between slots (`extra[SHARED_POOL_KEY]`,
  llama.cpp's automatic slots) is the most one request can hold, not what it
  is sure to get: short of the requirement it fails, at or above it the gate
  cannot pass (inconclusive).
"""

from __future__ import annotations

import math
from typing import Any

from kvfence.audit.base import CheckResult, Fact, Verdict, worst
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.targets.base import (
    RESERVED_KEY,
    SHARED_POOL_KEY,
    NodeFacts,
    Target,
    TargetFacts,
)


def _context_fact(ctx: AuditContext, target: Target, facts_context: Fact) -> Fact:
    if ctx.context_override is not None:
        return Fact(ctx.context_override, "--context (operator override)")
    return facts_context


class CapacityCheck(Check):
    name = "capacity"
    description = "KV pool >= context length × headroom, read from the live process"

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client = ctx.client(target, "a")
        facts = target.facts(client)
        pool = facts.pool_tokens
        context = _context_fact(ctx, target, facts.context_length)
        evidence = {
            "pool_tokens": pool.to_json(),
            "context_length": context.to_json(),
            "headroom": ctx.headroom,
            "engine": target.engine,
            "detected_by": target.detected_by,
        }
        if facts.nodes:
            return self._fleet(ctx, target, facts.nodes, facts.context_length, evidence)
        if (decode := self._decode_only(target, facts, evidence)) is not None:
            return decode
        guarantee = facts.extra.get("pool_guarantee_tokens")
        if not pool.known and guarantee is not None:
            if ctx.headroom != 1.0:
                return self._only_guaranteed(target, guarantee, ctx.headroom, evidence)
            pool = guarantee  # at headroom 1.0 the start-up guarantee is the whole claim
            evidence["pool_tokens"] = pool.to_json()
            return self._at_least(self._gate(target, pool, context, ctx.headroom, evidence))
        res = self._unusable(self._gate(target, pool, context, ctx.headroom, evidence), facts.extra)
        shared = facts.extra.get(SHARED_POOL_KEY)
        if shared is None or shared.value is not True or pool.as_int() is None:
            return res
        return self._bound(res, pool, shared)

    @staticmethod
    def _unusable(res: CheckResult, extra: dict[str, Fact]) -> CheckResult:
        """A pass by less than the tokens the pool counts but no request can use (vLLM's null
        block) is a proven shortfall: the usable pool is below the requirement."""
        reserved = extra.get(RESERVED_KEY)
        held = reserved.as_int() if reserved is not None else None
        margin, required = res.evidence.get("margin_tokens"), res.evidence.get("required_tokens")
        if reserved is None or held is None or res.verdict is not Verdict.PASS:
            return res
        if not isinstance(margin, int) or not isinstance(required, int) or margin >= held:
            return res
        usable = required + margin - held
        res.verdict = Verdict.FAIL
        res.evidence.update(
            reserved_tokens=reserved.to_json(),
            usable_tokens=usable,
            shortfall_tokens=required - usable,
        )
        res.summary = (
            f"{res.summary.split(' (margin')[0]} as stated, but {held:,} of it no request can "
            f"use ({reserved.note}; {reserved.source}): {usable:,} usable < {required:,}, "
            f"short by {required - usable:,} tokens"
        )
        return res

    @staticmethod
    def _at_least(res: CheckResult) -> CheckResult:
        """A start-up guarantee is a lower bound of the pool: it can pass the gate, but a
        guarantee below the need proves nothing about the pool's real size."""
        if res.verdict is Verdict.FAIL:
            res.verdict = Verdict.INCONCLUSIVE
            res.evidence.pop("fixes", None)
            res.summary = (
                f"{res.summary.split(':')[0]}, but that pool is only the start-up guarantee, a "
                "lower bound: the real pool may hold more, so a guarantee below the need is no "
                "proof of a short pool (the engine does not report its pool size)"
            )
        return res

    def _bound(self, res: CheckResult, pool: Fact, shared: Fact) -> CheckResult:
        """A pool that may be shared between slots: it can fail the gate, never pass it."""
        res.evidence[SHARED_POOL_KEY] = shared.to_json()
        why = f"{pool.as_int():,} is only a bound, at most what one request holds: {shared.note}"
        if res.verdict is Verdict.FAIL:
            res.summary += f" ({why})"
            return res
        if res.verdict is Verdict.PASS:
            res.verdict = Verdict.INCONCLUSIVE
            res.summary = (
                f"{res.summary}, but {why} ({shared.source}) — the gate cannot pass on a "
                "bound; run one slot (-np 1) or gate on the start-up log's kv_unified"
            )
        return res

    def _decode_only(
        self, target: Target, facts: TargetFacts, evidence: dict[str, Any]
    ) -> CheckResult | None:
        """A decode node's pool is not where the reject path fires (I4 is a prefill property)."""
        role = facts.extra.get("pd_role")
        if role is None or role.value != "decode":
            return None
        evidence["pd_role"] = role.to_json()
        return self.result(
            target,
            Verdict.INCONCLUSIVE,
            f"decode node ({role.source}): prompts are written into the prefill nodes' "
            "pools, where the reject path fires, so a decode pool proves nothing about the "
            "fleet — audit the router URL or every prefill node",
            evidence,
        )

    def _only_guaranteed(
        self, target: Target, guarantee: Fact, headroom: float, evidence: dict[str, Any]
    ) -> CheckResult:
        evidence["pool_guarantee_tokens"] = guarantee.to_json()
        return self.result(
            target,
            Verdict.INCONCLUSIVE,
            f"KV pool size not reported; the engine only guarantees {guarantee.value} tokens "
            f"at start-up ({guarantee.source}), one full request, not × {headroom} — failing "
            "closed (headroom 1.0 gates on the guarantee)",
            evidence,
        )

    def _gate(
        self,
        target: Target,
        pool: Fact,
        context: Fact,
        headroom: float,
        evidence: dict[str, Any],
    ) -> CheckResult:
        pool_n, context_n = pool.as_int(), context.as_int()
        if pool_n is None:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"KV pool size unknown ({pool.source}: {pool.note or 'not readable'}); "
                "failing closed — the gate cannot pass without it",
                evidence,
            )
        if context_n is None:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"context length unknown ({context.source}); pass --context N",
                evidence,
            )
        required = math.ceil(context_n * headroom)
        evidence["required_tokens"] = required
        evidence["margin_tokens"] = pool_n - required
        evidence["ratio"] = round(pool_n / context_n, 4) if context_n else None
        if pool_n >= required:
            return self.result(
                target,
                Verdict.PASS,
                f"pool {pool_n:,} ≥ context {context_n:,} × {headroom} = {required:,} "
                f"(margin {pool_n - required:,} tokens)",
                evidence,
            )
        shortfall = required - pool_n
        evidence["shortfall_tokens"] = shortfall
        evidence["fixes"] = fixes(pool_n, context_n, headroom)
        return self.result(
            target,
            Verdict.FAIL,
            f"pool {pool_n:,} < context {context_n:,} × {headroom} = {required:,}: "
            f"short by {shortfall:,} tokens ({pool_n / context_n:.2f}× context). "
            "A prompt near the context cannot fit: the reject path is live traffic",
            evidence,
        )

    def _fleet(
        self,
        ctx: AuditContext,
        target: Target,
        nodes: list[NodeFacts],
        fleet_context: Fact,
        evidence: dict[str, Any],
    ) -> CheckResult:
        """Every prefill node gated on its own pool against its own context (I4 per node)."""
        rows: list[dict[str, Any]] = []
        verdicts: list[Verdict] = []
        for node in nodes:
            row: dict[str, Any] = {"node": node.url, **node.to_json()}
            if node.prefills:
                own = node.context_length
                context = _context_fact(ctx, target, own if own.known else fleet_context)
                res = self._unusable(
                    self._gate(target, node.pool_tokens, context, ctx.headroom, {}), node.extra
                )
                row.update(gated=True, verdict=res.verdict.value, detail=res.summary)
                verdicts.append(res.verdict)
            else:
                row.update(gated=False, detail="decode node: its pool is not the reject path's")
            rows.append(row)
        evidence["nodes"] = rows
        prefill = [r for r in rows if r["gated"]]
        if not prefill:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"no prefill node among {len(rows)} workers: the gate cannot pass on decode pools",
                evidence,
            )
        verdict = worst(verdicts)
        bad = [r for r in prefill if r["verdict"] != Verdict.PASS.value]
        if not bad:
            summary = f"all {len(prefill)} prefill nodes hold the context × {ctx.headroom}: " + (
                "; ".join(f"{r['node']}: {r['detail']}" for r in prefill)
            )
        else:
            summary = "; ".join(f"{r['node']} ({r['role']['value']}): {r['detail']}" for r in bad)
        return self.result(target, verdict, summary, evidence)


def fixes(pool: int, context: int, headroom: float) -> list[str]:
    """What an operator can do, with the numbers filled in."""
    max_context = int(pool / headroom)
    factor = context * headroom / pool
    return [
        f"lower the advertised context to ≤ {max_context:,} tokens "
        "(SGLang --context-length, vLLM --max-model-len, llama.cpp -c)",
        f"grow the KV pool ×{factor:.2f} (more KV memory: SGLang --mem-fraction-static, "
        "vLLM --gpu-memory-utilization / VLLM_CPU_KVCACHE_SPACE, fewer concurrent slots, "
        "more tensor-parallel ranks, a smaller KV dtype)",
        f"or reject prompt + max_tokens > {pool:,} with HTTP 400 at the edge, before any "
        "allocation or transfer (keeps throughput, fails legitimate long requests)",
    ]
