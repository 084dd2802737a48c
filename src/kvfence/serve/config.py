"""The server's validated configuration, and the capacity decision made from the live pools (I4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfence.engine.backend import PoolInfo
from kvfence.engine.sizing import DEFAULT_HEADROOM, GateReport, capacity_gate
from kvfence.faults import Fault, FaultSet
from kvfence.kv.scrub import ScrubPolicy

# A serving process whose live pools fail the capacity gate (I4) exits with this, unserved.
EXIT_GATE = 1


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What the router needs to know about the model, the engine and the lab.

    context_length: the advertised window (`max_model_len`).
    vocab_size: token ids a prompt may contain (the model's embedding rows).
    default_max_tokens: used when a request gives none (completions and chat).
    engine facts (scrub, transport, disaggregated, prefix_cache,
    shared_prefix_cache) are read from the backend's own configuration by
    whoever builds the server and only reported here.
    """

    model_name: str
    context_length: int
    vocab_size: int
    headroom: float = DEFAULT_HEADROOM
    allow_undersized_pool: bool = False
    faults: FaultSet = field(default_factory=FaultSet)
    lab_profile: str | None = None
    default_max_tokens: int = 16
    scrub: ScrubPolicy = ScrubPolicy.NONE
    transport: str = "inprocess"  # the registry name of the transport that runs
    disaggregated: bool = False
    prefix_cache: bool = True
    shared_prefix_cache: bool = False  # the operator's explicit opt-in (I8)
    body_timeout_s: float = 60.0  # a request body not whole by then is a 408 (slowloris)

    def __post_init__(self) -> None:
        for name in ("context_length", "vocab_size", "default_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ServeConfig.{name} must be a positive integer, got {value!r}")
        if not self.model_name:
            raise ValueError("ServeConfig.model_name must not be empty")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.headroom < 1.0:
            raise ValueError(f"headroom must be >= 1.0, got {self.headroom}")

    @property
    def prefix_namespacing(self) -> str:
        shared = self.shared_prefix_cache or Fault.SHARED_PREFIX_CACHE in self.faults
        return "shared" if shared else "tenant"


@dataclass(frozen=True, slots=True)
class Capacity:
    """The start-up decision: the gate's report and the router's edge limit on prompt + max_tokens."""

    report: GateReport
    edge_limit: int  # max_req_input_len
    undersized: bool
    gate_skipped: bool  # only under the lab's `undersized-pool` fault
    max_total_num_tokens: int  # the smallest prefill pool, in tokens


def pool_tokens_for_gate(pools: Sequence[PoolInfo]) -> tuple[int, int]:
    """(tokens the gate checks: the smallest pool of any role, the smallest prefill pool).

    A request must fit whole in the prefill pool (its prompt) and in the
    decode pool (prompt + output), so the gate checks the smallest of all.
    """
    if not pools:
        # Fail closed: an engine that cannot say its pool size does not start (I4).
        raise ValueError("the backend reports no KV pools; cannot run the capacity gate")
    prefill = [p.pool_tokens for p in pools if p.role == "prefill"] or [
        p.pool_tokens for p in pools
    ]
    return min(p.pool_tokens for p in pools), min(prefill)


def decide_capacity(config: ServeConfig, pools: Sequence[PoolInfo]) -> Capacity:
    """Run the gate on the live pools. Raises `CapacityGateError` when the server must not start."""
    gate_tokens, prefill_tokens = pool_tokens_for_gate(pools)
    report = GateReport(gate_tokens, config.context_length, config.headroom)
    if Fault.UNDERSIZED_POOL in config.faults:
        # Lab: the Workers AI configuration. No gate, and the edge admits the full context.
        return Capacity(report, config.context_length, not report.passed, True, prefill_tokens)
    decision = capacity_gate(
        gate_tokens,
        config.context_length,
        headroom=config.headroom,
        allow_undersized=config.allow_undersized_pool,
    )
    return Capacity(
        decision.report, decision.edge_limit, decision.undersized, False, prefill_tokens
    )
