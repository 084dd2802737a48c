"""Which waiting prompt prefill admits next: the shortest, with a bound on how often one is passed.

Prompts that finish in the same step get their first tokens together, at the
end of it, so the order the step budget is filled in decides time to first
token. Arrival order (FCFS, vLLM's and SGLang's default) makes a burst's short
prompts wait for the long ones that arrived before them. Shortest first
(`PrefillOrder.SHORTEST`, the default) admits the shortest waiting prompt
first: the same steps and the same tokens per step, so the same throughput,
but the prompts that are quick to prefill answer first, which lowers the
median and mean time to first token of a burst.

The bound, against starvation: a prompt overtaken by `max_overtakes` later
arrivals joins the aged class, which goes before every other waiting prompt in
arrival order. Nothing overtakes an aged prompt: admission stops at the first
prompt that cannot get its pages, and a later arrival can only be admitted after
it. So no prompt is overtaken more than `max_overtakes` times.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: the command line offers PrefillOrder's choices
    from kvfence.engine.prefill_seq import PrefillSeq


class PrefillOrder(enum.Enum):
    """The order waiting prompts are admitted in (running prompts' chunks always go first)."""

    SHORTEST = "shortest"  # shortest prompt first, overtaking bounded
    ARRIVAL = "arrival"  # first come, first served


def admission_order(
    waiting: Iterable[PrefillSeq], order: PrefillOrder, max_overtakes: int
) -> list[PrefillSeq]:
    """The waiting prompts (kept in arrival order) in the order admission tries them."""
    if order is PrefillOrder.ARRIVAL:
        return list(waiting)

    def key(seq: PrefillSeq) -> tuple[int, int, int]:
        if seq.overtaken >= max_overtakes:
            return (0, 0, seq.arrival)  # aged: before everyone, in arrival order
        return (1, len(seq.input_ids), seq.arrival)

    return sorted(waiting, key=key)


def note_admitted(waiting: Iterable[PrefillSeq], admitted: PrefillSeq) -> None:
    """`admitted` leaves the queue: every earlier arrival still waiting was overtaken once."""
    for seq in waiting:
        if seq.arrival < admitted.arrival:
            seq.overtaken += 1
