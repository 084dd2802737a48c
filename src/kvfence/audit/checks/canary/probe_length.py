"""Over-long probes (pool + 1, limit + 1) whose length is measured, never assumed.

A reject-path probe must be provably over its bound (the pool, or the input
limit): a calibrated text prompt can tokenize shorter than planned (a head
word merging with the filler) and land at or under it, where it tests nothing. Its real length comes from
the tokenizer that admits it: token ids count themselves; a text prompt is
counted with `POST /tokenize` on the target or, behind a router that serves
none, on a prefill worker the router lists (the pool is that node's). While
the count is at or under the bound, filler is appended and the prompt counted
again. The engine's own `usage.prompt_tokens`, where it answers 200, is
recorded beside the count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvfence.audit.base import JSONValue
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.fleet import origin, sibling
from kvfence.audit.prompts import Prompt, PromptMaker
from kvfence.audit.targets.base import TargetFacts

MAX_GROW_ROUNDS = 4


Counter = Callable[[str], "int | None"]


@dataclass(slots=True)
class OverLong:
    """An over-long probe: its prompt, its bound, its measured length and who counted it."""

    label: str
    prompt: Prompt
    bound: int  # the pool or the input limit the probe must exceed
    tokens: int | None  # measured; None when nothing could count it
    source: str
    grown_by: int = 0  # filler tokens appended after the first count

    @property
    def verified(self) -> bool:
        return self.tokens is not None and self.tokens > self.bound

    def to_json(self, responses: list[ProbeResponse]) -> dict[str, JSONValue]:
        usage = [r.prompt_tokens for r in responses if r.ok and r.prompt_tokens is not None]
        return {
            "label": self.label,
            "bound": self.bound,
            "prompt_tokens": self.tokens,
            "measured_by": self.source,
            "grown_by_tokens": self.grown_by,
            "verified_over_bound": self.verified,
            "usage_prompt_tokens": list(usage),  # the engine's own count, where it answered 200
        }


class TokenCounter:
    """Counts a text prompt's tokens with some `/tokenize` that serves this pool (or none)."""

    def __init__(self, client: ProbeClient, facts: TargetFacts) -> None:
        self._own: ProbeClient | None = None
        self.client: ProbeClient | None = None
        self.source = "nothing (no /tokenize on the target or any prefill worker)"
        if facts.tokenizer.value == "/tokenize":
            self.client, self.source = client, "POST /tokenize on the target"
            return
        for node in facts.nodes:
            if not (node.reached and node.prefills):
                continue
            c = sibling(client, node.url)  # its origin: a tenant route needs no router path
            c.model = client.model
            if c.tokenize("hello world"):
                self.client = self._own = c
                self.source = f"POST /tokenize on prefill worker {origin(node.url)}"
                return
            c.close()

    def count(self, prompt: Prompt) -> int | None:
        if isinstance(prompt.payload, list):
            return len(prompt.payload)
        toks = self.client.tokenize(prompt.payload) if self.client else None
        return len(toks) if toks else None

    def close(self) -> None:
        if self._own is not None:
            self._own.close()


def over_bound(
    maker: PromptMaker, counter: TokenCounter, label: str, p: Prompt, bound: int
) -> OverLong:
    """`p` grown until its measured length is over `bound` (a few rounds at most)."""
    source = "token ids (exact)" if isinstance(p.payload, list) else counter.source
    n = counter.count(p)
    probe = OverLong(label, p, bound, n, source)
    for _ in range(MAX_GROW_ROUNDS):
        if n is None or n > bound:
            break
        grown = maker.grow(probe.prompt, bound + 1 - n)
        if grown is None:
            break
        m = counter.count(grown)
        probe.grown_by += (m or n) - n
        probe.prompt, probe.tokens, n = grown, m, m
    return probe
