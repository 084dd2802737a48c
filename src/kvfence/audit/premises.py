"""Premise facts: what an engine states that decides whether a check's question can arise.

Some checks ask a question that exists only under a premise: a cross-tenant
prefix-cache hit needs a prefix cache, salt isolation needs `cache_salt`, a
failed KV transfer needs disaggregation. Where the engine itself states that
the premise is false — read over HTTP, with the endpoint and field — the check
uses it, names the fact that decided, and answers decisively instead of
"inconclusive" for a question that cannot arise (a deploy gate that blocks for
a reason that does not apply is a false alarm).

Rules every caller follows:
- Only a premise *stated false* decides (`Premise.absent`). An unknown one
  decides nothing: the check runs as before, and unknown is never a pass.
- A stated fact is a claim, not a proof. Where a probe can still test the
  claim (prefix sharing), the check keeps probing, and a leak under a
  stated-off premise is a FAIL that names the contradicted fact. Only where
  nothing can be measured (no counters to compare) does the verdict rest on
  the fact alone, and then it is NOT_APPLICABLE, never PASS.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvfence.audit.base import Fact, JSONValue
from kvfence.audit.targets.base import TargetFacts

PD_ROLES = ("prefill", "decode", "mixed")


@dataclass(frozen=True, slots=True)
class Premise:
    """One premise of a check, and the engine fact that states whether it holds."""

    name: str  # what must exist for the question to arise: "a prefix cache"
    fact: Fact  # value True (holds), False (stated off) or None (unknown)

    @property
    def absent(self) -> bool:
        """The engine states the premise does not hold (the only case that decides)."""
        return self.fact.value is False

    def stated(self) -> str:
        """'GET /server_info prefix_cache.enabled = False' (with the fact's note) — for summaries."""
        note = f"; {self.fact.note}" if self.fact.note else ""
        return f"{self.fact.source} = {self.fact.value}{note}"

    def decided(self, consequence: str) -> str:
        """The sentence a check prints when this premise decided it."""
        return f"premise: the engine has no {self.name} ({self.stated()}), so {consequence}"

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "premise": self.name,
            "holds": self.fact.value if isinstance(self.fact.value, bool) else None,
            "decides": self.absent,
            "fact": self.fact.to_json(),
        }


def prefix_cache(facts: TargetFacts) -> Premise:
    """Whether any prefix cache can serve one request from another's KV."""
    fact = facts.prefix_caching
    if not isinstance(fact.value, bool):
        fact = Fact(None, fact.source, fact.note or "not stated as true or false")
    return Premise("prefix cache", fact)


def salt_support(facts: TargetFacts) -> Premise:
    """Whether the engine honours `cache_salt` (else a salted run tests nothing)."""
    fact = facts.cache_salt_supported
    if not isinstance(fact.value, bool):
        fact = Fact(None, fact.source, fact.note or "not stated as true or false")
    return Premise("cache_salt support", fact)


def disaggregation(facts: TargetFacts) -> Premise:
    """Whether KV moves between processes (prefill/decode), so a transfer can fail or mismatch.

    From, in order: kvfence's own `disaggregated`, an adapter's engine-level
    statement (`extra["disaggregated"]`), the live P/D role an adapter read
    (`extra["pd_role"]`: "unified" is not disaggregated), a fleet's node roles.
    """
    name = "prefill/decode disaggregation"
    stated = facts.extra.get("disaggregated")
    if stated is not None and isinstance(stated.value, bool):
        return Premise(name, stated)
    role = facts.extra.get("pd_role")
    if role is not None and role.known:
        value = role.value in PD_ROLES
        return Premise(name, Fact(value, role.source, f"P/D role {role.value!r}"))
    roles = [n.role for n in facts.nodes]
    if roles and all(r.known for r in roles):
        split = any(r.value in PD_ROLES for r in roles)
        return Premise(name, Fact(split, "every fleet node's role", f"{len(roles)} nodes"))
    return Premise(name, Fact.unknown("P/D role", "the engine does not say whether it is split"))


Run = tuple[str, str | None, str | None]  # (label, A's salt, B's salt)


def prefix_runs(
    salt_mode: str,
    cache: Premise,
    salt: Premise,
    rng: random.Random,
) -> tuple[list[Run], dict[str, str]]:
    """The prefix-sharing check's runs to send, and why any run of its plan is not sent.

    `salt_mode` is `PrefixSharingConfig.salt` ("auto", "off", "only").

    The unsalted run is sent even when the engine states it has no prefix
    cache: that claim is what it tests (a KV connector or offload tier can
    share prefixes outside the engine's own cache flag), and a hit under it
    is a FAIL naming the contradicted fact. With `salt="auto"` the salted run
    is sent only where the engine states it honours cache_salt and has a
    prefix cache; each reason for leaving it out names the fact.
    """
    runs: list[Run] = []
    not_run: dict[str, str] = {}
    if salt_mode != "only":
        runs.append(("unsalted", None, None))
    want_salted = salt_mode == "only"
    if salt_mode == "auto":
        if cache.absent:
            not_run["salted"] = "not applicable: " + cache.decided(
                "there is no cached prefix for a salt to separate (the unsalted run tests the "
                "claim)"
            )
        elif salt.absent:
            not_run["salted"] = "not applicable: " + salt.decided(
                "there is no salted cache to isolate"
            )
        elif salt.fact.value is None:
            not_run["salted"] = (
                f"cache_salt support not stated ({salt.fact.source}): salt isolation is not "
                "claimed either way"
            )
        else:
            want_salted = True
    if want_salted:
        tag = f"{rng.getrandbits(48):012x}"
        runs.append(("salted", f"kvfence-audit-a-{tag}", f"kvfence-audit-b-{tag}"))
    return runs, not_run
