"""A small SGLang-shaped worker on loopback, for the router fleet tests.

It answers what a real sglang-router 0.3.2 reads from a worker (`/health`,
`/server_info`, `/model_info`, `/v1/models`, `/metrics`) in SGLang 0.5.23's
shapes (see fixtures/sglang/README.md), and serves completions under 0.5.23's
real length rules, so the audit's boundary rungs are judged against the rule
the engine enforces:

- tokenizer: reject `input >= context_len` and `input + max_new_tokens > context_len`;
- scheduler: reject `input >= max_req_input_len`, where
  `max_req_input_len = min(context_len - 1, token_capacity - 1) - 5`.

Text is "tokenized" one whitespace-separated word per token; an accepted
completion echoes the start of its own prompt (the content checks can tell
it is its own).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VERSION = "0.5.23"


@dataclass
class WorkerSpec:
    mode: str  # "prefill" | "decode" | "null"
    capacities: list[int]  # one KV pool (tokens) per scheduler / attention-DP rank
    context_len: int
    model_path: str
    bootstrap_port: int | None = None
    counters: dict[str, float] = field(default_factory=dict)
    enable_metrics: bool = True
    # how a request picks its DP rank: "round_robin", or "most_free" (SGLang's
    # minimum-tokens balancing on an idle node: the rank with the largest pool)
    dp_balance: str = "round_robin"


def max_req_input_len(spec: WorkerSpec, rank: int = 0) -> int:
    """0.5.23 tp_worker: min(context_len - 1, kv_capacity - 1) - 5, per rank (reported: rank 0's)."""
    return min(spec.context_len - 1, spec.capacities[rank] - 1) - 5


def server_info(spec: WorkerSpec) -> dict[str, Any]:
    """/server_info: resolved server args + rank 0's scheduler info + one internal state per rank."""
    n = len(spec.capacities)
    args: dict[str, Any] = {
        "model_path": spec.model_path,
        "tokenizer_path": spec.model_path,
        "served_model_name": spec.model_path,
        "context_length": spec.context_len,
        "page_size": 1,
        "disable_radix_cache": False,
        "disaggregation_mode": spec.mode,
        "disaggregation_bootstrap_port": spec.bootstrap_port or 8998,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_enable_kv_checksum": False,
        "disaggregation_decode_enable_radix_cache": False,
        "tp_size": n,
        "dp_size": 1,
        "attn_dp_size": n,
        "enable_dp_attention": n > 1,
        "allow_auto_truncate": False,
        "enable_metrics": spec.enable_metrics,
    }
    states = [
        {
            **args,
            "world_size": n,
            "last_gen_throughput": 0.0,
            "memory_usage": {
                "weight": 1.0,
                "kvcache": 2.0,
                "startup_available": 10.0,
                "token_capacity": cap,
                "token_capacity_swa": None,
                "graph": {},
            },
            **({"disaggregation_mode": spec.mode} if spec.mode != "null" else {}),
        }
        for cap in spec.capacities
    ]
    return {
        **args,
        "launch_command": f"python -m sglang.launch_server --model-path {spec.model_path}",
        "status": "ready",
        "max_total_num_tokens": spec.capacities[0],
        "max_req_input_len": max_req_input_len(spec),
        "startup_time": 1.0,
        "internal_states": states,
        "version": VERSION,
        "frontend": "python",
    }


def metrics(spec: WorkerSpec) -> str:
    """Prometheus text as prometheus_client writes it: one family at a time, HELP/TYPE first."""
    engine_type = {"prefill": "prefill", "decode": "decode"}.get(spec.mode, "unified")
    labels = [
        f'engine_type="{engine_type}",model_name="{spec.model_path}",'
        f'moe_ep_rank="0",pp_rank="0",tp_rank="{rank}",dp_rank="{rank}"'
        for rank in range(len(spec.capacities))
    ]
    lines = [
        "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV pool.",
        "# TYPE sglang:max_total_num_tokens gauge",
    ]
    lines += [
        f"sglang:max_total_num_tokens{{{lab}}} {float(c)}"
        for lab, c in zip(labels, spec.capacities, strict=True)
    ]
    for name, value in spec.counters.items():
        # prometheus_client 0.2x: the family keeps `_total`; `_created` is its own gauge.
        created = name.removesuffix("_total") + "_created"
        lines += [f"# HELP {name} Failure counter.", f"# TYPE {name} counter"]
        lines += [f"{name}{{{lab}}} {value if i == 0 else 0.0}" for i, lab in enumerate(labels)]
        lines += [f"# HELP {created} Failure counter.", f"# TYPE {created} gauge"]
        lines += [f"{created}{{{lab}}} 1.7e+09" for lab in labels]
    return "\n".join(lines) + "\n"


def _reject(spec: WorkerSpec, n: int, max_new: int, rank: int) -> str | None:
    if n >= spec.context_len:
        return f"The input ({n} tokens) is longer than the model's context length"
    if n + max_new > spec.context_len:
        return "Requested token count exceeds the model's maximum context length"
    if n >= max_req_input_len(spec, rank):  # the scheduler of the rank the request landed on
        return f"Input length ({n} tokens) exceeds the maximum allowed length"
    return None


class SglangWorker:
    """One worker process stand-in: a ThreadingHTTPServer on an ephemeral loopback port."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.seen: list[str] = []
        self.requests = 0
        self.hide_info = False  # True: /server_info answers 404 (an unreadable node)
        self.on_post: Callable[[str, dict[str, Any]], None] | None = None  # test hook
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def _get(self, path: str) -> tuple[int, str, str]:
        spec = self.spec
        if path in ("/health", "/health_generate"):
            return 200, "", "text/plain"
        if path in ("/server_info", "/get_server_info") and not self.hide_info:
            return 200, json.dumps(server_info(spec)), "application/json"
        if path in ("/model_info", "/get_model_info"):
            body = {
                "model_path": spec.model_path,
                "tokenizer_path": spec.model_path,
                "served_model_name": spec.model_path,
                "is_generation": True,
                "disaggregation_mode": spec.mode,
            }
            return 200, json.dumps(body), "application/json"
        if path == "/v1/models":
            card = {
                "id": spec.model_path,
                "object": "model",
                "owned_by": "sglang",
                "root": spec.model_path,
                "max_model_len": spec.context_len,
            }
            return 200, json.dumps({"object": "list", "data": [card]}), "application/json"
        if path == "/metrics" and spec.enable_metrics:
            return 200, metrics(spec), "text/plain; version=0.0.4"
        return 404, json.dumps({"detail": "Not Found"}), "application/json"

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, str, str]:
        if self.on_post is not None:
            self.on_post(path, body)
        if path == "/tokenize":
            words = str(body.get("prompt", "")).split()
            return 200, json.dumps({"tokens": [len(w) for w in words]}), "application/json"
        if path not in ("/v1/completions", "/generate"):
            return 404, json.dumps({"detail": "Not Found"}), "application/json"
        prompt = body.get("prompt", body.get("text", body.get("input_ids", "")))
        words = prompt.split() if isinstance(prompt, str) else None
        n = len(words) if words is not None else len(prompt) if isinstance(prompt, list) else 0
        max_new = int(
            body.get("max_tokens", (body.get("sampling_params") or {}).get("max_new_tokens", 16))
        )
        self.requests += 1
        caps = self.spec.capacities
        rank = (
            caps.index(max(caps))
            if self.spec.dp_balance == "most_free"
            else self.requests % len(caps)
        )
        why = _reject(self.spec, n, max_new, rank)
        if why is not None:
            err = {"object": "error", "message": why, "type": "BadRequestError", "code": 400}
            return 400, json.dumps(err), "application/json"
        text = " ".join(words[:max_new]) if words else " ".join(["tok"] * max_new)
        out = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": self.spec.model_path,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": n,
                "completion_tokens": max_new,
                "total_tokens": n + max_new,
            },
        }
        return 200, json.dumps(out), "application/json"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                """Silence the access log."""

            def _send(self, status: int, body: str, ctype: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                worker.seen.append(f"GET {self.path}")
                self._send(*worker._get(self.path))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b"{}"
                worker.seen.append(f"POST {self.path}")
                self._send(*worker._post(self.path, json.loads(raw or b"{}")))

        return Handler
