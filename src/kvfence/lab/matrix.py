"""The defence matrix: the incident scenario under every subset of the incident profile's defences.

Each of the four incident switches removes one defence. Running the scenario
with every combination of them turned back on proves defence in depth: the
leak must occur ONLY when all four are off, and any single defence turns it
into a clean error (HTTP 4xx/5xx with an error body, nothing of A's data).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfence.faults import Fault, FaultSet
from kvfence.lab.profiles import INCIDENT_FAULTS
from kvfence.lab.scenario import Outcome, ScenarioResult, ServerFactory, lab_server, run_incident

ROWS = ("all", "singles")  # every subset, or the incident plus each defence alone


@dataclass(frozen=True, slots=True)
class MatrixRow:
    defences_on: frozenset[Fault]  # the incident switches turned OFF (their defence restored)
    result: ScenarioResult

    @property
    def expected(self) -> Outcome:
        return Outcome.LEAK if not self.defences_on else Outcome.CLEAN_ERROR

    @property
    def as_expected(self) -> bool:
        return self.result.outcome is self.expected


def combinations(rows: str = "all") -> list[frozenset[Fault]]:
    """The defence sets to run: all 2^4, or "singles" (none, then each one alone)."""
    if rows not in ROWS:
        raise ValueError(f"unknown matrix rows {rows!r}; known: {', '.join(ROWS)}")
    sizes = range(len(INCIDENT_FAULTS) + 1) if rows == "all" else (0, 1)
    return [frozenset(c) for r in sizes for c in itertools.combinations(INCIDENT_FAULTS, r)]


def run_matrix(
    checkpoint: Path,
    *,
    seed: int = 0,
    progress: Callable[[int, int, MatrixRow], None] | None = None,
    combos: list[frozenset[Fault]] | None = None,
    server: ServerFactory = lab_server,
    also: FaultSet | None = None,
) -> list[MatrixRow]:
    """Each combination, from every defence off (the incident) to every defence on (default: all 2^4).

    `also`: switches outside the incident turned on in every row; one that breaks a defence
    (e.g. `abort-as-success`) turns its rows red, which shows the matrix can fail.
    """
    combos = combinations() if combos is None else combos
    rows: list[MatrixRow] = []
    for i, defences in enumerate(combos):
        extra = also.active if also is not None else frozenset()
        faults = FaultSet((frozenset(INCIDENT_FAULTS) - defences) | extra)
        row = MatrixRow(defences, run_incident(checkpoint, faults, seed=seed + i, server=server))
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(combos), row)
    return rows
