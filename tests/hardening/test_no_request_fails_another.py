"""No request can fail another: bounded at the edge, isolated in the step, honest on /health.

Live servers on loopback, real HTTP. Tenant A sends what once took the engine
down (a top_k of 2**63), or a request that gets past the edge and makes its
step raise (the lab switch `poisoned-sampling`: sampling raises for a request
seeded with POISON_SEED + k from its output token k on). Tenant B's six
concurrent requests, decoding in the very steps where A's raises, must finish
with 200 and exactly the text each gets alone; A's request fails alone, the
engine keeps serving, /health stays true, and no page is left held. In the
hub (`kvfence serve --disaggregated --router kvfence`) the same holds and the
stack keeps running. An engine fault that no request explains turns /health
false with a reason and answers later requests with a 503 at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hardening_helpers import hub_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfence.faults import POISON_SEED, Fault, FaultSet
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, ServerParts, build_local
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

B_PROMPTS = [f"tenant b, request {i}: the quick brown fox" for i in range(6)]
CONTEXT = 4096  # the tiny model's
B_TOKENS = 600  # B's streams run this long (~4 ms a step here: seconds) ...
POISONED_AT = 4  # ... and A's request, sent while they decode, fails at its 4th token
TOP_K_LIMIT = str(2**31 - 1)


@dataclass
class Server:
    url: str
    keys: dict[str, str]
    model: str
    parts: ServerParts | None = None

    def post(self, tenant: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/completions",
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
            json={"model": self.model, **body},
            timeout=timeout,
        )


@dataclass
class Stream:
    """One streamed completion: its text, finish reason, errors, and when its events came."""

    status: int = 0
    text: str = ""
    finish: str | None = None
    errors: list[str] = field(default_factory=list)
    first_s: float = float("inf")  # when its first token came
    started: threading.Event = field(default_factory=threading.Event)  # first token, or ended
    ended_s: float = 0.0


def stream(server: Server, tenant: str, body: dict[str, Any], out: Stream) -> Stream:
    headers = {"Authorization": f"Bearer {server.keys[tenant]}"}
    payload = {"model": server.model, **body, "stream": True}
    try:
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", headers=headers, json=payload, timeout=180
        ) as r:
            out.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.errors.append(str(event["error"]))
                    continue
                choice = event["choices"][0]
                out.text += choice["text"]
                out.finish = choice["finish_reason"] or out.finish
                out.first_s = min(out.first_s, time.monotonic())
                out.started.set()
    finally:
        out.ended_s = time.monotonic()
        out.started.set()
    return out


def b_body(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": B_TOKENS, "temperature": 0, "ignore_eos": True}


def alone(server: Server) -> list[str]:
    """Each of B's prompts run by itself, one after another: the text each must get."""
    texts = []
    for prompt in B_PROMPTS:
        r = server.post("b", b_body(prompt))
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def b_streams_while(
    server: Server, attack: dict[str, Any]
) -> tuple[httpx.Response, list[Stream], float]:
    """B's six streams, then A's `attack` once each has its first token (all six decoding);
    returns A's answer, B's streams and when A's answer came."""
    streams = [Stream() for _ in B_PROMPTS]
    with ThreadPoolExecutor(len(B_PROMPTS)) as pool:
        running = [
            pool.submit(stream, server, "b", b_body(p), s)
            for p, s in zip(B_PROMPTS, streams, strict=True)
        ]
        for s in streams:
            assert s.started.wait(120), "a stream of tenant B had no first token within 120 s"
        answer = server.post("a", attack)
        answered_s = time.monotonic()
        for f in running:
            f.result(timeout=180)
    return answer, streams, answered_s


def assert_shared_steps(streams: list[Stream], answered_s: float) -> None:
    """A's request ended while every B stream was decoding (its first token before A's
    answer, its last after): A's request failed in the steps B's rows were in."""
    apart = [i for i, s in enumerate(streams) if not s.first_s < answered_s < s.ended_s]
    assert not apart, (
        f"B's streams {apart} were not decoding when A's request failed: "
        "A's failure did not share their steps (raise B_TOKENS)"
    )


def assert_b_served(streams: list[Stream], expected: list[str]) -> None:
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        assert s.status == 200 and not s.errors, (i, s.status, s.errors)
        assert s.finish == "length" and s.text == want, (i, s.finish, s.text[:80], want[:80])


def assert_still_serving(server: Server, expected: list[str]) -> None:
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200, health.text
    r = server.post("a", b_body(B_PROMPTS[0]))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0], r.text


def huge_top_k_is_a_400(server: Server) -> None:
    for top_k in (2**63, 2**31):
        r = server.post("a", {"prompt": "hi", "max_tokens": 4, "top_k": top_k})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "top_k" and TOP_K_LIMIT in err["message"], err


# ---- single process ---------------------------------------------------------------------------


def registry() -> TenantRegistry:
    tenants = TenantRegistry.generate(("a", "b")).with_operator_keys(("op-key-no-request-fails-0",))
    return tenants.without_default_limits()  # six concurrent requests of one tenant


@contextmanager
def single(checkpoint: Path, kind: str = "mirror") -> Iterator[Server]:
    parts = build_local(
        LocalSpec(
            checkpoint,
            kind=kind,
            context_length=CONTEXT,
            pools=PoolSizes(prefill_pages=512, decode_pages=1024),
            faults=FaultSet.of(Fault.POISONED_SAMPLING),
        )
    )
    tenants = registry()
    keys = {t.name: t.keys[0] for t in tenants.tenants}
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv:
            yield Server(srv.url, keys, parts.config.model_name, parts)
    finally:
        parts.pipeline.stop()


def assert_no_page_held(server: Server) -> None:
    assert server.parts is not None
    pipeline = server.parts.pipeline
    assert pipeline.wait_idle(timeout=60), "the engine did not go idle within 60 s"
    pipeline.clear_prefix_cache()
    pipeline.check_integrity()
    for pool in (pipeline.prefill_pool, pipeline.decode_pool):
        assert pool.num_free == pool.num_pages, (pool.num_used, pool.num_pending)


@pytest.fixture(scope="module")
def live(hardening_checkpoint: Path) -> Iterator[tuple[Server, list[str]]]:
    with single(hardening_checkpoint) as server:
        yield server, alone(server)


def test_huge_top_k_is_a_400_while_another_tenant_is_served(
    live: tuple[Server, list[str]],
) -> None:
    server, expected = live
    attack = {"prompt": "hi", "max_tokens": 4, "top_k": 2**63}
    answer, streams, _ = b_streams_while(server, attack)
    assert answer.status_code == 400, answer.text
    err = answer.json()["error"]
    assert err["param"] == "top_k" and TOP_K_LIMIT in err["message"], err
    assert_b_served(streams, expected)
    huge_top_k_is_a_400(server)
    assert_still_serving(server, expected)
    assert_no_page_held(server)


def test_a_request_whose_step_raises_fails_alone(live: tuple[Server, list[str]]) -> None:
    server, expected = live
    attack = {"prompt": "poison", "max_tokens": 64, "seed": POISON_SEED + POISONED_AT}
    answer, streams, answered_s = b_streams_while(server, attack)
    assert_b_served(streams, expected)
    assert answer.status_code == 500, answer.text
    assert "poisoned-sampling" in answer.json()["error"]["message"], answer.text
    assert_shared_steps(streams, answered_s)
    assert_still_serving(server, expected)
    assert_no_page_held(server)


def test_an_engine_fault_turns_health_false_and_answers_at_once(
    hardening_checkpoint: Path,
) -> None:
    """A model that cannot run anything (its embedding emptied): no request is blamed."""
    with single(hardening_checkpoint, kind="llama") as server:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        assert server.parts is not None
        model = server.parts.loaded.model
        hidden = server.parts.loaded.config.hidden_size
        model.embed = torch.nn.Parameter(torch.empty(0, hidden))  # type: ignore[assignment]
        r = server.post("b", {"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and "index out of range" not in r.text, r.text
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 503, health.text
        assert "engine" in health.json()["error"]["message"], health.text
        late = server.post("a", {"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert late.status_code == 503, late.text


# ---- the hub: kvfence serve --disaggregated --router kvfence --------------------------------


@contextmanager
def hub(checkpoint: Path, tmp_path: Path) -> Iterator[tuple[Server, subprocess.Popen[str]]]:
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(registry().to_json())
    keys = {t.name: t.keys[0] for t in TenantRegistry.from_file(tenants_file).tenants}
    args = ("--model", str(checkpoint), "--model-kind", "mirror", "--kv-pages", "1024",
            "--tenants", str(tenants_file), "--lab-fault", Fault.POISONED_SAMPLING.value)  # fmt: skip
    with hub_cli(args, tmp_path, 240) as (text, proc):
        m = re.search(r"at (http://\S+)", text)
        assert m, f"the hub did not announce its URL within 240 s:\n{text}"
        yield Server(m.group(1), keys, checkpoint.name), proc


@pytest.mark.slow
def test_in_the_hub_a_request_whose_step_raises_fails_alone_and_the_stack_stays(
    hardening_checkpoint: Path, tmp_path: Path
) -> None:
    with hub(hardening_checkpoint, tmp_path) as (server, proc):
        expected = alone(server)
        huge_top_k_is_a_400(server)
        attack = {"prompt": "poison", "max_tokens": 64, "seed": POISON_SEED + POISONED_AT}
        answer, streams, answered_s = b_streams_while(server, attack)
        assert_b_served(streams, expected)
        assert answer.status_code == 500, answer.text
        assert "poisoned-sampling" in answer.json()["error"]["message"], answer.text
        assert_shared_steps(streams, answered_s)
        assert proc.poll() is None, "the hub exited after one request failed"
        assert_still_serving(server, expected)
        assert proc.poll() is None


# ---- every numeric field across its whole JSON range ------------------------------------------

# The JSON numbers worth trying: any size of integer, every finite float (JSON has no NaN or
# Infinity; the strict parser refuses them), the edges of both, and the values that are
# integers in one reading and floats in another.
JSON_NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, -1, 0]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, -0.0, 0.0, 258.0, 1.0, 2.0, 0.5, 1e-300]),
    st.booleans(),
    st.none(),
)
# field -> (route, how the value is placed): a scalar, or the one item of a list field.
NUMERIC_FIELDS: dict[str, tuple[str, str]] = {
    **{
        name: ("completions", "scalar")
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")
    },
    "stop_token_ids": ("completions", "item"),
    "prompt": ("completions", "item"),
    **{name: ("chat", "scalar") for name in ("max_completion_tokens", "top_logprobs")},
    **{
        name: ("completions", "scalar")
        for name in ("n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty")
    },
}
PROPERTY = settings(
    max_examples=int(os.environ.get("KVFENCE_NUMERIC_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


def numeric_body(field_name: str, route: str, place: str, value: object) -> dict[str, Any]:
    if route == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        if field_name == "top_logprobs":
            body["logprobs"] = True
    else:
        body = {"prompt": "hi", "max_tokens": 2}
    body[field_name] = [value] if place == "item" else value
    return body


def test_every_numeric_field_across_its_json_range_is_served_or_named(
    live: tuple[Server, list[str]],
) -> None:
    """2xx, or a 4xx that names the field; never a 5xx; the server serves on afterwards."""
    server, expected = live
    paths = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
    seen: dict[int, int] = {}

    @PROPERTY
    @given(
        field_name=st.sampled_from(sorted(NUMERIC_FIELDS)), value=JSON_NUMBERS, chat=st.booleans()
    )
    def check(field_name: str, value: object, chat: bool) -> None:
        route, place = NUMERIC_FIELDS[field_name]
        if chat and field_name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            route = "chat"  # the fields both routes take: drawn on each
        body = {"model": server.model, **numeric_body(field_name, route, place, value)}
        r = httpx.post(
            server.url + paths[route],
            content=json.dumps(body),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {server.keys['a']}",
            },
            timeout=120,
        )
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (field_name, value, r.status_code, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["param"] == field_name, (field_name, value, r.status_code, err)
            assert err["message"], err

    check()
    print(f"statuses over {sum(seen.values())} requests: {dict(sorted(seen.items()))}")
    assert set(seen) & {200} and set(seen) & {400}, seen  # the draw reached both outcomes
    assert_still_serving(server, expected)
    assert_no_page_held(server)


# ---- the hub's /health follows its workers ---------------------------------------------------


@pytest.mark.slow
def test_the_hubs_health_is_false_while_a_role_has_no_live_worker(
    hardening_checkpoint: Path,
) -> None:
    """A decode worker frozen past the liveness window: /health 503 naming decode; back to
    200 once it reports again (the real router role's PDBackend, real worker processes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pd"))
    from pd_helpers import cluster

    with cluster(hardening_checkpoint) as c:
        assert httpx.get(f"{c.url}/health", timeout=30).status_code == 200
        liveness = c.backend.timeouts.liveness_s
        c.signal("decode-0", signal.SIGSTOP)
        try:
            end = time.monotonic() + liveness + 30
            health = httpx.get(f"{c.url}/health", timeout=30)
            while health.status_code == 200 and time.monotonic() < end:
                time.sleep(0.2)
                health = httpx.get(f"{c.url}/health", timeout=30)
            assert health.status_code == 503, f"/health still 200 {liveness + 30:.0f} s on"
            assert "decode" in health.json()["error"]["message"], health.text
        finally:
            c.signal("decode-0", signal.SIGCONT)
        end = time.monotonic() + 60
        while httpx.get(f"{c.url}/health", timeout=30).status_code != 200:
            assert time.monotonic() < end, "/health not back to 200 within 60 s of SIGCONT"
            time.sleep(0.2)
