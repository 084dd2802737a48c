"""The capacity fingerprint of a target: the live facts whose change re-runs the gate."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvfence.audit.targets.base import TargetFacts

# Engine-specific facts an adapter may put in `TargetFacts.extra` that size the pool or
# change who shares it (parallelism, lab switches, prefix-cache policy, disaggregation).
EXTRA_KEYS = (
    "version",
    "tensor_parallel_size",
    "data_parallel_size",
    "dp_size",
    "tp_size",
    "lab_faults",
    "disaggregated",
    "undersized_pool",
    "pd_role",
)

Value = int | float | bool | str | None


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What the guard compares between intervals (None: the adapter could not read it)."""

    engine: Value
    model: Value
    pool_tokens: Value
    context_length: Value
    max_input: Value
    page_size: Value
    prefix_caching: Value
    extra: tuple[tuple[str, Value], ...] = ()

    @classmethod
    def of(cls, facts: TargetFacts) -> Fingerprint:
        extra = tuple((k, facts.extra[k].value) for k in EXTRA_KEYS if k in facts.extra)
        return cls(
            engine=facts.engine.value,
            model=facts.model.value,
            pool_tokens=facts.pool_tokens.value,
            context_length=facts.context_length.value,
            max_input=facts.max_input.value,
            page_size=facts.page_size.value,
            prefix_caching=facts.prefix_caching.value,
            extra=extra,
        )

    @property
    def gateable(self) -> bool:
        """Whether the gate's inputs are known (else the facts are unknown: fail closed)."""
        return isinstance(self.pool_tokens, int) and isinstance(self.context_length, int)

    def diff(self, old: Fingerprint) -> list[str]:
        """What changed from `old`, as `name: old -> new`."""
        out = []
        for f in fields(self):
            if f.name == "extra":
                continue
            a, b = getattr(old, f.name), getattr(self, f.name)
            if a != b:
                out.append(f"{f.name}: {a} -> {b}")
        mine, theirs = dict(self.extra), dict(old.extra)
        for k in sorted(set(mine) | set(theirs)):
            if mine.get(k) != theirs.get(k):
                out.append(f"{k}: {theirs.get(k)} -> {mine.get(k)}")
        return out
