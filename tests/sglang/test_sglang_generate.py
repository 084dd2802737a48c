"""SGLang's native `/generate` on kvfence's PD workers, through the real sglang-router 0.3.2.

Same admission as the OpenAI routes: the tenant's key (I10), bootstrap fields
only on the router's path and `rid` never (I9), a 400 that names any field
kvfence does not honour. One stack for the module (~4 s to start).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sgl_helpers import Fleet, complete, fleet, text_of, wait_quiet

from kvfence.serve.errors import ApiError
from kvfence.sglang_stack.generate import completion_body

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def stack(sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(sgl_checkpoint, tmp_path_factory.mktemp("generate")) as f:
        yield f


def _post(url: str, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/generate", headers=headers, json=body, timeout=60)


def _error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text)
    return dict(r.json()["error"])


def _names(r: httpx.Response, field: str) -> bool:
    """The router re-wraps a worker's 400 (code `decode_bad_request`) but keeps its message."""
    return f"`{field}`" in _error(r)["message"]


@pytest.mark.slow
def test_generate_through_the_router_is_the_tenants_own(stack: Fleet) -> None:
    key = stack.keys["tenant-a"]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    by_text = _post(stack.url, key, {"text": PROMPT, "sampling_params": params})
    assert by_text.status_code == 200, by_text.text
    got = by_text.json()
    ids = stack.tokenizer.encode(PROMPT)
    # The mirror model replays the KV it attends: its own prompt, through the real transfer.
    assert got["text"] == stack.tokenizer.decode(ids[:12])
    meta = got["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 12), meta
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    # The same answer as the OpenAI route, and from token ids (the router keeps them here).
    assert complete(stack, "tenant-a", PROMPT, 12, ignore_eos=True).text == got["text"]
    by_ids = _post(stack.url, key, {"input_ids": ids, "sampling_params": params})
    assert by_ids.status_code == 200 and by_ids.json()["text"] == got["text"], by_ids.text
    assert wait_quiet(stack, "decode")["integrity"] == "ok"


@pytest.mark.slow
def test_generate_streams_the_text_so_far_and_ends_with_the_counts(stack: Fleet) -> None:
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 6}}
    r = _post(stack.url, stack.keys["tenant-b"], {**body, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})  # fmt: skip
    assert r.status_code == 200, r.text
    events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts)), texts
    assert texts[-1] == stack.tokenizer.decode(stack.tokenizer.encode(PROMPT)[:6])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]["meta_info"]
    assert (
        last["finish_reason"] == {"type": "length", "length": 6} and last["completion_tokens"] == 6
    )


@pytest.mark.slow
def test_generate_refuses_what_it_does_not_honour_through_the_router(stack: Fleet) -> None:
    key = stack.keys["tenant-a"]
    for params, field in (
        ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty"),
        ({"n": 2}, "sampling_params.n"),
        ({"max_new_tokens": 0}, "sampling_params.max_new_tokens"),
        ({"temperature": -1}, "sampling_params.temperature"),
    ):
        r = _post(stack.url, key, {"text": "hi", "sampling_params": params})
        assert _names(r, field), r.text
    assert _names(_post(stack.url, key, {"text": "hi", "return_logprob": True}), "return_logprob")
    # I9: the router forwards a client's rid; the workers refuse it.
    assert _names(_post(stack.url, key, {"text": "hi", "rid": "mine"}), "rid")
    # Over the pool (336): the prefill worker's original error, and decode frees its reservation.
    long = text_of(stack.tokenizer, "weather report ", 424)
    err = _error(_post(stack.url, key, {"text": long, "sampling_params": {"max_new_tokens": 16}}))
    assert "336" in err["message"], err
    facts = wait_quiet(stack, "decode")
    assert (facts["pages_used"], facts["pages_pending"], facts["integrity"]) == (0, 0, "ok")


@pytest.mark.slow
def test_generate_on_a_worker_keeps_the_key_and_bootstrap_rules(stack: Fleet) -> None:
    key = stack.keys["tenant-a"]
    for role in ("prefill", "decode"):
        direct = stack.worker(role).url  # no router credential
        err = _error(_post(direct, key, {"text": "hi", "bootstrap_room": 7}))
        assert err["param"] == "bootstrap_room", err
        assert _error(_post(direct, key, {"text": "hi"}))["code"] == "pd_worker_direct"
        routed = stack.stack.router_url_of(stack.worker(role))  # the router's own path
        assert _post(routed, None, {"text": "hi"}).status_code == 401
        assert _post(routed, "sk-not-a-key", {"text": "hi"}).status_code == 401
        # An unknown field the router would drop is refused where it arrives, named.
        assert _error(_post(routed, key, {"text": "hi", "zork": 1}))["param"] == "zork"


def test_generate_body_maps_onto_the_completion_fields() -> None:
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 5}
    got = completion_body(
        {
            "input_ids": [1, 2],
            "model": None,
            "stream": True,
            "log_metrics": True,
            "sampling_params": {"max_new_tokens": 3, "top_k": -1, "sampling_seed": 5, "n": 1},
            **room,
        }
    )
    assert got == {
        **room,
        "prompt": [1, 2],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 3,
        "top_k": -1,
        "seed": 5,
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {}}, "input_ids"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": ["a", "b"]}, "text"),
        ({"input_ids": [[1], [2]]}, "input_ids"),
        ({"text": "a", "sampling_params": {"regex": "x"}}, "sampling_params.regex"),
        ({"text": "a", "sampling_params": [1]}, "sampling_params"),
        ({"text": "a", "log_metrics": False}, "log_metrics"),
        ({"text": "a", "lora_path": "x"}, "lora_path"),
        ({"text": "", "sampling_params": {}}, "text"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": -2}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": "a", "sampling_params": {"sampling_seed": "x"}}, "sampling_params.sampling_seed"),
    ],
)
def test_generate_body_refuses_what_it_cannot_honour(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        completion_body(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
