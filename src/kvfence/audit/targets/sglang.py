"""SGLang: `/server_info` (newer) or `/get_server_info` (older), `/v1/models`, `/metrics`.

Shapes (from SGLang's http_server: the response is the ServerArgs dataclass,
merged with the scheduler's start-up info, plus `internal_states` per DP
rank and `version`):
- `max_total_num_tokens` — the KV pool in tokens (scheduler info; also in
  `internal_states[i]` and the gauge `sglang:max_total_num_tokens`);
- `max_req_input_len` — the longest prompt the scheduler admits;
- server args: `context_length` (None unless set), `page_size`,
  `disable_radix_cache`, `disaggregation_mode` ("null" | "prefill" | "decode"),
  `dp_size`, `served_model_name`.
PD counters (Prometheus): `sglang:num_transfer_failed_reqs_total`,
`sglang:num_bootstrap_failed_reqs_total` (older releases: no `_total`).
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

INFO_PATHS = ("/server_info", "/get_server_info")
PD_COUNTERS = (
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
    "sglang:num_transfer_failed_reqs",
    "sglang:num_bootstrap_failed_reqs",
)


def _server_info(ep: Endpoints) -> tuple[dict[str, Any] | None, str]:
    for path in INFO_PATHS:
        info = ep.json(path)
        if info is not None:
            return info, path
    return None, " or ".join(INFO_PATHS)


class SglangTarget(Target):
    engine: ClassVar[str] = "sglang"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        info, path = _server_info(endpoints)
        if info is None or info.get("engine") == "kvfence":
            return None
        if "max_total_num_tokens" in info and (
            "internal_states" in info or "disaggregation_mode" in info or "model_path" in info
        ):
            return f"GET {path} has SGLang's shape (server args + max_total_num_tokens)"
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        ep = Endpoints(client)
        info, path = _server_info(ep)
        model, entry = models_fact(ep)
        facts = TargetFacts(engine=Fact("sglang", f"GET {path}"), model=model)
        samples = ep.metrics()
        if info is None:
            facts.pool_tokens = self._pool_from_metrics(samples) or Fact.unknown(
                path, "no server info endpoint answered, no sglang:max_total_num_tokens"
            )
        else:
            facts.pool_tokens = self._pool(info, path, samples)
            v, _ = json_int(info, "max_req_input_len")
            if v is None:
                v = _first_internal(info, "max_req_input_len")
            facts.max_input = (
                Fact(v, f"GET {path} max_req_input_len")
                if v is not None
                else Fact.unknown(f"GET {path} max_req_input_len", "absent")
            )
            ps, _ = json_int(info, "page_size")
            facts.page_size = Fact(ps, f"GET {path} page_size") if ps else Fact.unknown(path)
            drc = info.get("disable_radix_cache")
            if isinstance(drc, bool):
                facts.prefix_caching = Fact(
                    not drc, f"GET {path} disable_radix_cache", f"disable_radix_cache={drc}"
                )
            mode = info.get("disaggregation_mode")
            if isinstance(mode, str):
                facts.extra["disaggregation_mode"] = Fact(mode, f"GET {path} disaggregation_mode")
            dp, _ = json_int(info, "dp_size")
            if dp is not None:
                facts.extra["dp_size"] = Fact(dp, f"GET {path} dp_size")
            if isinstance(info.get("version"), str):
                facts.extra["version"] = Fact(info["version"], f"GET {path} version")
        facts.context_length = self._context(info, path, entry)
        ctx_len, mri = facts.context_length.as_int(), facts.max_input.as_int()
        if ctx_len is not None and (mri is None or ctx_len - 2 < mri):
            # SGLang rejects input + max_new_tokens >= context_len: with max_tokens=1 the
            # longest prompt is context_len - 2.
            facts.max_input = Fact(
                ctx_len - 2,
                f"{facts.context_length.source} - 2",
                "SGLang rejects input + max_new_tokens >= context_len",
            )
        if info is not None and isinstance(info.get("allow_auto_truncate"), bool):
            facts.extra["allow_auto_truncate"] = Fact(
                info["allow_auto_truncate"],
                f"GET {path} allow_auto_truncate",
                "when true, over-long prompts are truncated and answered 200",
            )
        facts.cache_salt_supported = Fact.unknown(
            "SGLang API", "not advertised over HTTP; the prefix-sharing check probes it"
        )
        facts.tokenizer = tokenizer_fact(client)
        facts.counters = self._counters(samples)
        return facts

    def _pool(self, info: dict[str, Any], path: str, samples: list[Sample] | None) -> Fact:
        top, _ = json_int(info, "max_total_num_tokens")
        per_rank = [
            v
            for st in _internal_states(info)
            if (v := json_int(st, "max_total_num_tokens")[0]) is not None
        ]
        if per_rank:
            # A request lands on one DP rank: the gate needs the smallest rank pool.
            low = min(per_rank)
            if top is not None and top != low:
                return Fact(
                    min(top, low),
                    f"GET {path} max_total_num_tokens / internal_states[*].max_total_num_tokens",
                    f"top-level {top} vs per-rank min {low}: the smaller is used",
                )
            return Fact(
                low, f"GET {path} internal_states[*].max_total_num_tokens (min over DP ranks)"
            )
        if top is not None:
            return Fact(top, f"GET {path} max_total_num_tokens")
        return self._pool_from_metrics(samples) or Fact.unknown(
            f"GET {path} max_total_num_tokens", "absent (field names vary by SGLang version)"
        )

    @staticmethod
    def _pool_from_metrics(samples: list[Sample] | None) -> Fact | None:
        found = samples_named(samples or [], "sglang:max_total_num_tokens")
        if not found:
            return None
        return Fact(
            int(min(s.value for s in found)),
            "GET /metrics sglang:max_total_num_tokens (min over label sets)",
        )

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
        return self._counters(Endpoints(client).metrics())

    @staticmethod
    def _counters(samples: list[Sample] | None) -> dict[str, Fact]:
        out: dict[str, Fact] = {}
        for name in PD_COUNTERS:
            found = samples_named(samples or [], name)
            if found:
                out[name] = Fact(int(sum(s.value for s in found)), f"GET /metrics {name}")
        return out


def _internal_states(info: dict[str, Any]) -> list[dict[str, Any]]:
    st = info.get("internal_states")
    if isinstance(st, dict):
        return [st]
    if isinstance(st, list):
        return [s for s in st if isinstance(s, dict)]
    return []


def _first_internal(info: dict[str, Any], key: str) -> int | None:
    for st in _internal_states(info):
        v, _ = json_int(st, key)
        if v is not None:
            return v
    return None
