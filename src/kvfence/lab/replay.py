"""`kvfence lab replay`: watch the incident happen, then watch the defences stop it.

Runs the scenario twice on the same scaled geometry — once under the profile's
fault switches, once hardened — and shows side by side what tenant B received.
With the mirror model the leak is verbatim text. With the llama model the
leak shows as B's greedy output changing with A's traffic: B's request is
replayed after two different A workloads and the two answers compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfence.faults import FaultSet
from kvfence.lab.profiles import Profile
from kvfence.lab.scenario import Outcome, ScenarioResult, run_incident


@dataclass(frozen=True, slots=True)
class ReplaySide:
    label: str
    results: tuple[ScenarioResult, ...]  # one per A workload (two for llama)

    @property
    def leaked(self) -> bool:
        first = self.results[0]
        if first.model_kind == "mirror":
            return first.outcome is Outcome.LEAK
        # llama: a 200 whose content depends on another tenant's traffic
        return (
            all(r.b.status == 200 for r in self.results)
            and len({r.b.text for r in self.results}) > 1
        )

    @property
    def clean_error(self) -> bool:
        return all(r.outcome is Outcome.CLEAN_ERROR for r in self.results)


@dataclass(frozen=True, slots=True)
class Replay:
    profile: Profile
    incident: ReplaySide
    hardened: ReplaySide

    @property
    def reproduced(self) -> bool:
        """The leak under the profile, and a clean error with the defences on."""
        return self.incident.leaked and self.hardened.clean_error


def run_replay(
    checkpoint: Path, profile: Profile, *, model_kind: str | None = None, seed: int = 0
) -> Replay:
    kind = model_kind or profile.model_kind
    topics = ("invoice",) if kind == "mirror" else ("invoice", "medical record")

    def side(label: str, faults: FaultSet) -> ReplaySide:
        results = tuple(
            run_incident(
                checkpoint,
                faults,
                model_kind=kind,
                scale=profile.scale,
                seed=seed,
                a_topic=t,
                profile=profile.name,
            )
            for t in topics
        )
        return ReplaySide(label, results)

    return Replay(profile, side(profile.name, profile.faults), side("hardened", FaultSet()))
