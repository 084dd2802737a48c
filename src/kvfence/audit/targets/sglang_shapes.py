"""SGLang's `/server_info` shapes, read into facts (pure functions: no HTTP).

Read from SGLang's own source (0.5.23 and 0.4.6; see
tests/audit/fixtures/sglang/README.md for the files):

- 0.5.23 `/server_info` (and the deprecated `/get_server_info`, same body):
  resolved server args + the scheduler's start-up info + `internal_states`,
  one entry per scheduler / attention-DP rank, + `version`. The top-level
  `max_total_num_tokens` and `max_req_input_len` are the **first** rank's
  (the DP controller keeps `infos[0]`); every rank's pool is
  `internal_states[i].memory_usage.token_capacity`, and its live role
  `internal_states[i].disaggregation_mode` (a node can switch role).
  `--dp-size N --enable-dp-attention` resolves to `attn_dp_size=N, dp_size=1`.
- 0.4.6: no `/server_info`; `/get_server_info` is server args + scheduler
  info + rank 0's internal state flattened into the top level; its
  `/metrics` carry no pool gauge.
- Length rules. Scheduler (both): `max_req_input_len = min(context_len - 1,
  pool - 1) - 5` per rank, and a prompt with `len >= max_req_input_len` is
  rejected. Tokenizer: 0.5.23 rejects `input >= context_len` and
  `input + max_new_tokens > context_len`; 0.4.6 rejects `... >= context_len`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvfence.audit.base import Fact
from kvfence.audit.targets.base import Sample, json_int, samples_named

POOL_GAUGE = "sglang:max_total_num_tokens"
SCHEDULER_MARGIN = 5  # max_req_input_len = max_req_len - 5
NEW_TOKENIZER_RULE = (0, 5, 23)  # input + max_new_tokens > context_len (read in 0.5.23)
OLD_TOKENIZER_RULE = (0, 4, 6)  # input + max_new_tokens >= context_len (read in 0.4.6)
ROLE_OF_MODE = {"prefill": "prefill", "decode": "decode", "null": "unified"}


@dataclass(frozen=True, slots=True)
class Rank:
    """One scheduler / attention-DP rank as `internal_states[index]` reports it."""

    index: int
    pool: int | None
    mode: str | None


def version_tuple(info: dict[str, Any] | None) -> tuple[int, ...] | None:
    v = (info or {}).get("version")
    if not isinstance(v, str):
        return None
    nums = re.findall(r"\d+", v.split("+")[0])[:3]
    return tuple(int(n) for n in nums) if nums else None


def ranks(info: dict[str, Any]) -> list[Rank] | None:
    """Every rank of the 0.5.23 shape, or None for the flattened (0.4.6) shape."""
    states = info.get("internal_states")
    if not isinstance(states, list):
        return None
    out = []
    for i, st in enumerate(states):
        if not isinstance(st, dict):
            out.append(Rank(i, None, None))
            continue
        mem = st.get("memory_usage")
        pool, _ = json_int(mem if isinstance(mem, dict) else None, "token_capacity")
        mode = st.get("disaggregation_mode")
        out.append(Rank(i, pool, mode if isinstance(mode, str) else None))
    return out


def expected_ranks(info: dict[str, Any]) -> int:
    """Schedulers one node runs: dp_size × attn_dp_size (0.4.6 has no attn_dp_size)."""
    dp, _ = json_int(info, "dp_size")
    attn, _ = json_int(info, "attn_dp_size")
    return max(1, dp or 1) * max(1, attn or 1)


def pool_fact(info: dict[str, Any], path: str, samples: list[Sample] | None) -> Fact:
    """The smallest rank's pool — a request lands on one rank, so the gate needs the smallest."""
    want = expected_ranks(info)
    rs = ranks(info)
    top, _ = json_int(info, "max_total_num_tokens")
    if rs:
        missing = [r.index for r in rs if r.pool is None]
        if missing:
            return Fact.unknown(
                f"GET {path} internal_states[*].memory_usage.token_capacity",
                f"ranks {missing} report no token_capacity: their pool cannot be vouched for",
            )
        if len(rs) < want:
            return Fact.unknown(
                f"GET {path} internal_states",
                f"{len(rs)} internal states for {want} ranks (dp_size × attn_dp_size)",
            )
        low = min(rs, key=lambda r: r.pool or 0)
        pools = ", ".join(f"rank {r.index}: {r.pool}" for r in rs)
        note = f"{len(rs)} ranks ({pools}); smallest is rank {low.index}"
        if top is not None and top != low.pool:
            note += f"; top-level max_total_num_tokens {top} is rank 0's only"
        return Fact(
            low.pool,
            f"GET {path} internal_states[*].memory_usage.token_capacity (min over ranks)",
            note,
        )
    from_metrics = pool_from_metrics(samples, want)
    if from_metrics is not None:
        return from_metrics
    if top is not None and want == 1:
        return Fact(top, f"GET {path} max_total_num_tokens", "one rank: the top level is its pool")
    if top is not None:
        return Fact.unknown(
            f"GET {path} max_total_num_tokens",
            f"top level is rank 0's pool ({top}) only, and the node runs {want} ranks",
        )
    return Fact.unknown(f"GET {path} max_total_num_tokens", "absent")


def pool_from_metrics(samples: list[Sample] | None, want: int = 1) -> Fact | None:
    """`sglang:max_total_num_tokens`, one series per rank (labels tp/pp/dp rank): the smallest."""
    found = samples_named(samples or [], POOL_GAUGE)
    if not found or len(found) < want:
        return None
    return Fact(
        int(min(s.value for s in found)),
        f"GET /metrics {POOL_GAUGE} (min over {len(found)} series)",
    )


def role_fact(info: dict[str, Any] | None, path: str, samples: list[Sample] | None) -> Fact:
    """The node's live P/D role: per rank, else the server arg, else the metrics' engine_type."""
    live = sorted({r.mode for r in ranks(info or {}) or [] if r.mode is not None})
    if live:
        roles = sorted({ROLE_OF_MODE.get(m, m) for m in live})
        role = roles[0] if len(roles) == 1 else "mixed"
        return Fact(role, f"GET {path} internal_states[*].disaggregation_mode", f"modes {live}")
    mode = (info or {}).get("disaggregation_mode")
    if isinstance(mode, str):
        return Fact(ROLE_OF_MODE.get(mode, mode), f"GET {path} disaggregation_mode (server arg)")
    types = sorted({s.labels["engine_type"] for s in samples or [] if "engine_type" in s.labels})
    if types:
        role = types[0] if len(types) == 1 else "mixed"
        return Fact(role, "GET /metrics engine_type label")
    return Fact.unknown(f"GET {path} disaggregation_mode", "no role reported")


def tokenizer_longest(context: int, version: tuple[int, ...] | None) -> tuple[int, str] | None:
    """The longest prompt the tokenizer admits with max_new_tokens=1, and the rule applied."""
    if version is not None and version >= NEW_TOKENIZER_RULE:
        return context - 1, "tokenizer rejects input + max_new_tokens > context_len (0.5.23)"
    if version is not None and version <= OLD_TOKENIZER_RULE:
        return context - 2, "tokenizer rejects input + max_new_tokens >= context_len (0.4.6)"
    return None


def max_input_fact(
    info: dict[str, Any], path: str, context: Fact, pool: Fact, version: tuple[int, ...] | None
) -> Fact:
    """The longest prompt every rank admits with max_tokens=1, and which rule/version gave it.

    The scheduler's rule (the same in 0.4.6 and 0.5.23) always binds before
    the tokenizer's: max_req_input_len <= context_len - 6, so the longest is
    max_req_input_len - 1, and each rank computes it from its own pool.
    """
    vname = ".".join(map(str, version)) if version else "unknown version"
    limits: list[tuple[int, str]] = []
    reported, _ = json_int(info, "max_req_input_len")
    if reported is not None:
        limits.append((reported - 1, f"max_req_input_len {reported} (rank 0's) - 1"))
    for name, bound in (("smallest rank pool", pool.as_int()), ("context_len", context.as_int())):
        if bound is not None:
            mri = bound - 1 - SCHEDULER_MARGIN
            limits.append((mri - 1, f"{name} {bound}: max_req_input_len <= {mri}, - 1"))
    if not limits:
        return Fact.unknown(f"GET {path} max_req_input_len", "absent, and no pool or context")
    n, why = min(limits)
    ctx = context.as_int()
    tok = tokenizer_longest(ctx, version) if ctx is not None else None
    tok_note = f"; {tok[1]}: {tok[0]}" if tok else ""
    return Fact(
        n,
        f"GET {path} max_req_input_len / internal_states / context_length",
        f"SGLang {vname}: the scheduler rejects len >= max_req_input_len "
        f"(min(context_len - 1, pool - 1) - 5 per rank; read in 0.4.6 and 0.5.23); "
        f"binding: {why}{tok_note}",
    )


def max_input_most(info: dict[str, Any], path: str, context: Fact, limit: Fact) -> Fact | None:
    """The longest prompt *some* rank admits, where ranks differ (each sizes its own limit).

    Rank 0's `max_req_input_len` is reported; every other rank's is at most
    `min(pool, context) - 6`. None when it equals `limit` (one rule for all).
    """
    rs = ranks(info) or []
    low = limit.as_int()
    if low is None or not rs or any(r.pool is None for r in rs):
        return None
    ctx = context.as_int()
    bounds = [
        min(r.pool or 0, ctx if ctx is not None else r.pool or 0) - 1 - SCHEDULER_MARGIN - 1
        for r in rs
    ]
    reported, _ = json_int(info, "max_req_input_len")
    most = max([*bounds, *([reported - 1] if reported is not None else [])])
    if most <= low:
        return None
    return Fact(
        most,
        f"GET {path} internal_states[*].memory_usage.token_capacity",
        f"ranks apply different limits ({low}..{most}); a prompt in between may be taken by a "
        "larger rank, so only one above every limit must be refused",
    )
