"""Does `cache_salt` separate one tenant's workloads on each route? (a router may drop it)

I8 namespaces the prefix cache per tenant *and* per salt. Tenants stay apart
by key whatever a router does with the salt, so the cross-tenant salted run
cannot see a salt that never arrives. This run stays inside tenant A: A warms
a prefix with salt 1, then reads it with salt 2 (must miss) beside a fresh
prefix, and with salt 1 again (the control: must hit). A different-salt hit
means the salt does not separate workloads on that route.

It runs where the target states that something in front of the engine drops
the salt on some route (`TargetFacts.extra["cache_salt_dropped_on"]`, e.g.
sglang-router 0.3.2 on `/v1/chat/completions`), on each route of
`PrefixSharingConfig.salt_routes`. A FAIL names the stated cause when the
route is one it drops the salt on; on a route that keeps the salt the same
probe must pass, so the stated fact alone never fails a route.
"""

from __future__ import annotations

import random

from kvfence.audit.base import Fact, JSONValue, Verdict
from kvfence.audit.checks.prefix_sharing.prompts import RandomPrompts
from kvfence.audit.checks.prefix_sharing.trials import (
    ROUTES,
    Arms,
    PrefixSharingConfig,
    TrialProbe,
    run_arms,
    same_salt_trials,
)
from kvfence.audit.client import ProbeClient
from kvfence.audit.stats import SequentialResult
from kvfence.audit.targets.base import TargetFacts
from kvfence.audit.targets.routers import SALT_DROPPED


def dropped_routes(facts: TargetFacts) -> tuple[Fact | None, tuple[str, ...]]:
    """The stated fact and the paths it names (comma-separated), or (None, ())."""
    fact = facts.extra.get(SALT_DROPPED)
    if fact is None or not isinstance(fact.value, str):
        return None, ()
    return fact, dropped_paths(fact)


def salt_route_run(
    cfg: PrefixSharingConfig,
    rng: random.Random,
    client: ProbeClient,
    prefix_len: int,
    like: RandomPrompts,
    route: str,
    dropped: Fact,
) -> tuple[Verdict, str, dict[str, JSONValue]]:
    """Tenant A alone on `route`: a different salt must miss and the same salt must hit."""
    path = ROUTES[route]
    probe = TrialProbe(cfg, rng, client, client, prefix_len, route=route)
    probe.prompts.like(like)
    if route == "chat" and not probe.prompts.to_text(client):
        return (
            Verdict.INCONCLUSIVE,
            f"{path}: could not size text prompts",
            {"path": path, "requests": 1},
        )
    tag = f"{rng.getrandbits(48):012x}"
    salt_1, salt_2 = f"kvfence-audit-{tag}-1", f"kvfence-audit-{tag}-2"
    other, seq = run_arms(probe, cfg, salt_1, salt_2)
    own, control = same_salt_trials(probe, salt_1, cfg)
    ev: dict[str, JSONValue] = {
        "path": path,
        "requests": other.requests + own.requests,
        "different_salt": _arm_evidence(other, seq),
        "same_salt": _arm_evidence(own, control),
    }
    verdict, summary = _verdict(cfg, (other, seq), (own, control), path, dropped)
    if verdict is Verdict.FAIL and path in dropped_paths(dropped):
        ev["likely_cause"] = f"{dropped.source}: {dropped.note}"
    return verdict, summary, ev


def _verdict(
    cfg: PrefixSharingConfig,
    different: tuple[Arms, SequentialResult | None],
    same: tuple[Arms, SequentialResult | None],
    path: str,
    dropped: Fact,
) -> tuple[Verdict, str]:
    (other, seq), (own, control) = different, same
    other_hit, same_hit = _hit(other, seq), _hit(own, control)
    names = path in dropped_paths(dropped)
    if other_hit:
        how = "same salt hits, different salt also hits" if same_hit else "different salt hits"
        summary = f"{path}: {how}: cache_salt does not separate one tenant's workloads here"
        if names:
            summary += f" (likely cause: {dropped.source} in front drops cache_salt on {path})"
        return Verdict.FAIL, summary
    errors = len(other.errors) + len(own.errors)
    if seq is None or errors > cfg.max_error_fraction * max(len(other.shared), 1):
        return Verdict.INCONCLUSIVE, f"{path}: {errors} trials failed"
    if not same_hit:
        return (
            Verdict.INCONCLUSIVE,
            f"{path}: a different salt misses, but the same salt never hit either: the salt's "
            "separation is not shown",
        )
    note = " although it is stated to drop the salt here" if names else ""
    requests = other.requests + own.requests
    return (
        Verdict.PASS,
        f"{path}: same salt hits, a different salt misses ({requests} requests){note}",
    )


def dropped_paths(fact: Fact) -> tuple[str, ...]:
    return tuple(p.strip() for p in str(fact.value).split(",") if p.strip())


def _hit(arms: Arms, seq: SequentialResult | None) -> bool:
    return bool(arms.cross_hits) or (seq is not None and seq.rejected)


def _arm_evidence(arms: Arms, seq: SequentialResult | None) -> dict[str, JSONValue]:
    return {
        "requests": arms.requests,
        "trials": len(arms.shared),
        "hit_by_cached_tokens": bool(arms.cross_hits),
        "hit_examples": arms.cross_hits[:2],
        "hit_by_timing_p": seq.p_value if seq is not None else None,
        "error_count": len(arms.errors),
        "errors": arms.errors[:3],
    }
