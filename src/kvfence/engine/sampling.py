"""Token sampling for a batch of rows, each with its own `SamplingParams`.

Greedy rows take the argmax. Other rows go through temperature, top-k and
top-p (all vectorised over the batch) and then draw with the exponential-race
trick (argmax of p / E, E ~ Exp(1)), which equals sampling from p.

A batch whose sampling raises is sampled again row by row (`sample_isolated`):
a row that raises alone fails its own request only.

Seeded requests are reproducible whatever else is in the batch and whichever
engine draws the token: the noise for output token `i` of a request comes from
a generator seeded with `(seed, i)` alone, so prefill (token 0) and decode
(tokens 1..) need to share nothing but the seed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.engine.messages import SamplingParams
from kvfence.engine.row_errors import RowError, StepFailed, describe
from kvfence.faults import Fault, FaultSet, poisoned_from

log = logging.getLogger(__name__)

TokenLogprobs = tuple[tuple[int, float], ...]
"""One output token's logprobs: (sampled id, its logprob) first, then the top-k alternatives."""

_MASK = 2**63 - 1


def step_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded with `seed`."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK


@dataclass(frozen=True, slots=True)
class SampleRow:
    params: SamplingParams
    index: int  # which output token this draw is (0 = the first, sampled by prefill)


@dataclass(frozen=True, slots=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


Sampled = tuple[int, TokenLogprobs | None]
"""One row's draw: the token and, when asked for, its logprobs."""


class Sampler:
    """Stateless except for the generator used by unseeded rows."""

    def __init__(self, seed: int | None = None, faults: FaultSet | None = None) -> None:
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.faults = faults or FaultSet()

    def sample_isolated(
        self, logits: torch.Tensor, rows: Sequence[SampleRow]
    ) -> list[Sampled | RowError]:
        """`sample`, with each row's outcome its own: when the batch raises, every row is
        sampled alone and a row that raises again is a `RowError` (its request fails, no
        other). `StepFailed` when every row raises alone and so does a draw of no request."""
        try:
            result = self.sample(logits, rows)
            return list(zip(result.tokens, result.logprobs, strict=True))
        except Exception as error:
            log.warning("sampling %d rows raised %s: sampling each alone", len(rows), error)
            first = error
        out: list[Sampled | RowError] = []
        for i, row in enumerate(rows):
            try:
                one = self.sample(logits[i : i + 1], [row])
                out.append((one.tokens[0], one.logprobs[0]))
            except Exception as e:
                out.append(RowError(i, describe(e)))
        if all(isinstance(o, RowError) for o in out):
            broken = self._probe(logits.shape[-1])
            if broken is not None:
                raise StepFailed(
                    f"every row of a {len(rows)}-row batch failed to sample ({describe(first)}), "
                    f"and so did a probe with default parameters ({broken})"
                ) from first
        return out

    def _probe(self, vocab: int) -> str | None:
        """None when a draw of no request (default parameters) works; else its error."""
        try:
            self.sample(torch.zeros(1, vocab), [SampleRow(SamplingParams(), 0)])
            return None
        except Exception as e:
            return describe(e)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        """logits: [B, V] float32 (one row per entry of `rows`)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sample rows")
        if Fault.POISONED_SAMPLING in self.faults and any(_poisoned(r) for r in rows):
            raise RuntimeError("lab fault poisoned-sampling: this batch holds a poisoned request")
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, dtype=torch.int64)
            drawn = self._draw(logits[idx], [rows[i] for i in random_rows])
            tokens[idx] = drawn
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(logits, rows, token_list))

    def _draw(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        scaled = logits / temps[:, None]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = scaled.shape[-1]
        rank = torch.arange(vocab)
        top_k = torch.tensor([r.params.top_k or vocab for r in rows], dtype=torch.int64)
        drop = rank[None, :] >= top_k[:, None]
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
        if bool((top_p < 1.0).any()):
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            drop |= before >= top_p[:, None]  # the top token always survives (before = 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            if r.params.seed is None:
                noise[i].exponential_(generator=self._generator)
            else:
                g = torch.Generator().manual_seed(step_seed(r.params.seed, r.index))
                noise[i].exponential_(generator=g)
        choice = (probs / noise).argmax(dim=-1, keepdim=True)
        return order.gather(-1, choice).squeeze(-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, rows: Sequence[SampleRow], tokens: list[int]
    ) -> list[TokenLogprobs | None]:
        wanted = [r.params.logprobs for r in rows]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if all(k is None for k in wanted):
            return out
        logp = logits.log_softmax(dim=-1)  # the model's own distribution, before temperature
        k_max = max(k or 0 for k in wanted)
        top_vals, top_ids = logp.topk(k_max, dim=-1) if k_max else (None, None)
        for i, k in enumerate(wanted):
            if k is None:
                continue
            chosen = ((tokens[i], float(logp[i, tokens[i]])),)
            alts: TokenLogprobs = ()
            if k and top_ids is not None and top_vals is not None:
                alts = tuple(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist(), strict=True))
            out[i] = chosen + alts
        return out


def _poisoned(row: SampleRow) -> bool:
    start = poisoned_from(row.params.seed)
    return start is not None and row.index >= start


def stop_reason(
    token: int, num_generated: int, params: SamplingParams, eos_ids: frozenset[int]
) -> str | None:
    """'stop' on a stop id (or eos unless ignore_eos), 'length' at max_tokens, else None."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
