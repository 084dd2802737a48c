"""Mixed batches: decode's tokens and prefill's chunks in one forward, so the weights are read once.

In one process the prefill role carries the decode engine (roles/prefill.py): the
two engines keep their own pools and page tables; only the model step is shared.
Decode's rows are planned first (one token each) and count against the step's
token budget; prefill's running and new prompts fill what is left (chunked
prefill), at least a page's worth so prompts progress however many rows decode. The model
verifies both pools' page tables before it writes or reads either (I1); when
the ledger refuses a row, each engine re-runs alone and fails just that row
(`runner.forward_together`). Greedy outputs equal the two-forward path's.
"""

from __future__ import annotations

from kvfence.engine.config import EngineConfig
from kvfence.engine.decode import DecodeEngine
from kvfence.engine.prefill import PrefillEngine
from kvfence.engine.runner import forward_together


def prefill_budget(config: EngineConfig, decode_tokens: int) -> int:
    """Prefill's share of a mixed step: what decode leaves of `max_batch_tokens`, >= a page."""
    floor = min(config.page_size, config.max_batch_tokens)
    return max(config.max_batch_tokens - decode_tokens, floor)


def mixed_step(prefill: PrefillEngine, decode: DecodeEngine) -> None:
    """plan decode -> plan prefill in the rest of the budget -> one forward -> finish both."""
    d_step = decode.plan_step() if decode.has_work else None
    budget = prefill_budget(prefill.config, len(d_step.rows) if d_step else 0)
    p_step = prefill.plan_step(budget) if prefill.has_work else None
    if p_step is not None and d_step is not None:
        p_out, d_out = forward_together(
            [(prefill.runner, p_step.rows), (decode.runner, d_step.rows)]
        )
        prefill.finish_step(p_step, p_out)
        decode.finish_step(d_step, d_out)
    elif p_step is not None:
        prefill.finish_step(p_step, prefill.runner.forward_checked(p_step.rows))
    elif d_step is not None:
        decode.finish_step(d_step, decode.runner.forward_checked(d_step.rows))
