"""SGLang worker: `/server_info` (0.5.x) or `/get_server_info` (0.4.x), `/v1/models`, `/metrics`.

The shapes and rules are in `sglang_shapes` (read from 0.5.23's and 0.4.6's
source). What this adapter adds on top:

- the pool is the smallest rank's, never the top level's (rank 0's);
- the live P/D role (`extra["pd_role"]`): a decode node's pool is not where
  the reject path fires, so the capacity gate never passes on one alone;
- failure counters on every role — transfer and bootstrap failures count on
  decode too (a KV checksum mismatch aborts with 500 there) — and whether
  SGLang checks transfer integrity at all (`disaggregation_enable_kv_checksum`,
  default false); `/metrics` exists only with `--enable-metrics`, so a P/D
  node without it has *unreadable* counters (inconclusive), not none;
- decode nodes cache prefixes by `disaggregation_decode_enable_radix_cache`,
  not `disable_radix_cache`; `cache_salt` is a body field of `/generate` and
  the OpenAI routes in 0.5.23; a client's `bootstrap_room` passes unchanged.
- a router (`sglang-router`) answers `/get_server_info` with
  `router_manager`: that is `targets.routers`, never this adapter.
- the server info's `version` picks the rules: those read in 0.4.6 and
  0.5.23 agree on what the pool figures mean, so releases between them are
  read by them; a version outside, or none stated, leaves the pool unknown.
- a hybrid sliding-window model (`memory_usage.token_capacity_swa` set on a
  rank) splits its KV into a full-attention and a sliding-window pool; how a
  long request is sized across the two was not read, so no pass on it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import (
    Endpoints,
    Sample,
    Target,
    TargetFacts,
    json_int,
    models_fact,
    samples_named,
    tokenizer_fact,
)
from kvfence.audit.targets.sglang_shapes import (
    NEW_TOKENIZER_RULE,
    max_input_fact,
    max_input_most,
    pool_fact,
    pool_from_metrics,
    role_fact,
    version_tuple,
)
from kvfence.audit.targets.versions import ReadRange, version_fact

INFO_PATHS = ("/server_info", "/get_server_info")
PD_COUNTERS = (
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
)
PD_ROLES = ("prefill", "decode", "mixed")
READ = ReadRange("SGLang", (0, 4, 6), (0, 5, 23), depth=3)


def server_info(ep: Endpoints) -> tuple[dict[str, Any] | None, str]:
    for path in INFO_PATHS:
        info = ep.json(path)
        if info is not None:
            return info, path
    return None, " or ".join(INFO_PATHS)


def is_router_info(info: dict[str, Any] | None) -> bool:
    return info is not None and "router_manager" in info


def counters_from(samples: list[Sample] | None, role: Fact, source: str) -> dict[str, Fact]:
    """The PD failure counters (summed over ranks); unknown where a P/D node exports none."""
    out: dict[str, Fact] = {}
    pd = role.value in PD_ROLES
    for name in PD_COUNTERS:
        found = samples_named(samples or [], name)
        if found:
            out[name] = Fact(int(sum(s.value for s in found)), f"{source} {name}")
        elif pd:
            why = "not answered (SGLang serves /metrics only with --enable-metrics)"
            out[name] = Fact.unknown(
                f"{source} {name}", why if samples is None else "absent from /metrics"
            )
    return out


def swa_ranks(info: dict[str, Any]) -> list[int]:
    """Ranks whose memory usage states a sliding-window pool beside the full one."""
    states = info.get("internal_states")
    out = []
    for i, st in enumerate(states if isinstance(states, list) else []):
        mem = st.get("memory_usage") if isinstance(st, dict) else None
        if isinstance(mem, dict) and mem.get("token_capacity_swa") not in (None, 0):
            out.append(i)
    return out


def pool_by_version(
    pool: Fact, info: dict[str, Any], stated: Fact, version: tuple[int, ...] | None
) -> Fact:
    """The pool as the stated version's rules read it, or unknown naming version / option."""
    why = READ.unknown_rules(version, stated, "max_total_num_tokens / token_capacity")
    seen = f" (it reads {pool.value:,} by {READ.named()}'s rules)" if pool.known else ""
    if why is not None:
        return Fact.unknown(f"{pool.source}; {stated.source} {stated.value}", why + seen)
    swa = swa_ranks(info)
    if swa:
        return Fact.unknown(
            f"{pool.source}; memory_usage.token_capacity_swa",
            f"ranks {swa} run a hybrid sliding-window pool beside the full-attention one: how "
            f"{READ.named()} sizes one long request across the two was not read, so neither "
            f"figure proves it fits{seen}",
        )
    rule = f"SGLang {stated.value} ({stated.source}), rules of {READ.named()}"
    if not pool.known:
        return Fact.unknown(pool.source, f"{pool.note}; {rule}")
    return Fact(pool.value, pool.source, f"{rule}: {pool.note}" if pool.note else rule)


class SglangTarget(Target):
    engine: ClassVar[str] = "sglang"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        info, path = server_info(endpoints)
        if info is None or info.get("engine") == "kvfence" or is_router_info(info):
            return None
        if "internal_states" in info or (
            "max_total_num_tokens" in info
            and ("disaggregation_mode" in info or "model_path" in info)
        ):
            return f"GET {path} has SGLang's shape (server args + scheduler info)"
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        ep = Endpoints(client)
        info, path = server_info(ep)
        model, entry = models_fact(ep)
        facts = TargetFacts(engine=Fact("sglang", f"GET {path}"), model=model)
        samples = ep.metrics()
        facts.context_length = self._context(info, path, entry)
        role = role_fact(info, path, samples)
        facts.extra["pd_role"] = role
        if info is None:
            facts.pool_tokens = pool_from_metrics(samples) or Fact.unknown(
                path, "no server info endpoint answered, no sglang:max_total_num_tokens"
            )
        else:
            self._info_facts(facts, info, path, samples, role)
        facts.tokenizer = tokenizer_fact(client)
        facts.counters = counters_from(samples, role, "GET /metrics")
        return facts

    def _info_facts(
        self,
        facts: TargetFacts,
        info: dict[str, Any],
        path: str,
        samples: list[Sample] | None,
        role: Fact,
    ) -> None:
        version = version_tuple(info)
        facts.pool_tokens = pool_fact(info, path, samples)
        facts.max_input = max_input_fact(
            info, path, facts.context_length, facts.pool_tokens, version
        )
        most = max_input_most(info, path, facts.context_length, facts.max_input)
        if most is not None:
            facts.extra["max_input_most"] = most
        stated = version_fact(info.get("version"), f"GET {path} version")
        facts.extra["version"] = stated
        facts.pool_tokens = pool_by_version(facts.pool_tokens, info, stated, version)
        ps, _ = json_int(info, "page_size")
        facts.page_size = Fact(ps, f"GET {path} page_size") if ps else Fact.unknown(path)
        facts.prefix_caching = self._prefix_caching(info, path, role)
        for key in ("disaggregation_mode", "dp_size", "attn_dp_size"):
            v = info.get(key)
            if isinstance(v, str | int) and not isinstance(v, bool):
                facts.extra[key] = Fact(v, f"GET {path} {key}")
        for key, note in (
            ("allow_auto_truncate", "when true, over-long prompts are truncated and answered 200"),
            (
                "disaggregation_enable_kv_checksum",
                "whether decode verifies each transfer's KV checksum (false: nothing checks it)",
            ),
        ):
            if isinstance(info.get(key), bool):
                facts.extra[key] = Fact(info[key], f"GET {path} {key}", note)
        if version is not None and version >= NEW_TOKENIZER_RULE:
            facts.cache_salt_supported = Fact(
                True,
                "SGLang 0.5.23 API (cache_salt body field of /generate and the OpenAI routes)",
                "the prefix-sharing check verifies it",
            )
        else:
            facts.cache_salt_supported = Fact.unknown(
                "SGLang API", "not advertised over HTTP; the prefix-sharing check probes it"
            )

    @staticmethod
    def _prefix_caching(info: dict[str, Any], path: str, role: Fact) -> Fact:
        if role.value == "decode":
            key = "disaggregation_decode_enable_radix_cache"
            v = info.get(key)
            if isinstance(v, bool):
                return Fact(v, f"GET {path} {key}", "decode nodes cache by this flag")
            return Fact.unknown(f"GET {path} {key}", "absent")
        drc = info.get("disable_radix_cache")
        if isinstance(drc, bool):
            return Fact(not drc, f"GET {path} disable_radix_cache", f"disable_radix_cache={drc}")
        return Fact.unknown(f"GET {path} disable_radix_cache", "absent")

    @staticmethod
    def _context(info: dict[str, Any] | None, path: str, entry: dict[str, Any] | None) -> Fact:
        if entry is not None:
            v, _ = json_int(entry, "max_model_len")
            if v is not None:
                return Fact(v, "GET /v1/models data[0].max_model_len")
        v, _ = json_int(info, "context_length")
        if v is not None:
            return Fact(v, f"GET {path} context_length (server arg)")
        return Fact.unknown(
            "GET /v1/models max_model_len; server arg context_length",
            "context_length not set on the command line and /v1/models has no max_model_len",
        )

    def read_counters(self, client: ProbeClient) -> dict[str, Fact]:
        ep = Endpoints(client)
        samples = ep.metrics()
        role = (
            self._facts.extra.get("pd_role", Fact.unknown("")) if self._facts else Fact.unknown("")
        )
        if not role.known:
            info, path = server_info(ep)
            role = role_fact(info, path, samples)
        return counters_from(samples, role, "GET /metrics")
