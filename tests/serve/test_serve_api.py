"""The OpenAI API with the real `openai` client against a real server on loopback (mirror model).

The mirror model echoes, in order, the tokens whose KV it attends to, so with
correct isolation a request's output is its own prompt, verbatim.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import IDLE, Served


def n_tokens(s: Served, text: str) -> int:
    r = s.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_completion_echoes_prompt_with_usage(mirror: Served) -> None:
    prompt = "canary-completion-7f3a the quick brown fox"
    n = n_tokens(mirror, prompt)
    r = mirror.client("a").completions.create(
        model=mirror.model, prompt=prompt, max_tokens=n, temperature=0
    )
    assert r.choices[0].text == prompt
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n, n, 2 * n)
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.id.startswith("cmpl-") and r.object == "text_completion"


def test_completion_from_token_ids(mirror: Served) -> None:
    ids = mirror.post("/tokenize", json={"prompt": "token ids in, text out"}).json()["tokens"]
    r = mirror.client("b").completions.create(
        model=mirror.model, prompt=ids, max_tokens=len(ids), temperature=0
    )
    assert r.choices[0].text == "token ids in, text out"
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_chat_applies_the_template(mirror: Served) -> None:
    messages = [{"role": "user", "content": "chat canary 91b2"}]
    templated = mirror.post("/tokenize", json={"messages": messages}).json()
    r = mirror.client("a").chat.completions.create(
        model=mirror.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=templated["count"],
        temperature=0,
    )
    # The template wraps the message in ChatML; the echo reaches <|im_end|>, the EOS.
    assert r.choices[0].message.content == "user\nchat canary 91b2"
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.prompt_tokens == templated["count"]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    r = mirror.client("a").chat.completions.create(
        model=mirror.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=templated["count"],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    # Special tokens are not shown in text.
    assert r.choices[0].message.content == "user\nchat canary 91b2\nassistant\n"
    assert r.choices[0].finish_reason == "length"


def test_streaming_completion_matches_and_reports_usage(mirror: Served) -> None:
    prompt = "streaming canary 55aa, one piece at a time"
    n = n_tokens(mirror, prompt)
    chunks = list(
        mirror.client("c").completions.create(
            model=mirror.model,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == prompt
    assert len({c.id for c in chunks}) == 1  # one id for the whole stream
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == n


def test_streaming_chat_raw_sse_framing(mirror: Served) -> None:
    body = {
        "model": mirror.model,
        "messages": [{"role": "user", "content": "sse"}],
        "max_tokens": 4,
        "stream": True,
    }
    with httpx.stream(
        "POST", mirror.url + "/v1/chat/completions", json=body, headers=mirror.headers()
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["object"] == "chat.completion.chunk"


def test_stop_string_cuts_text_before_it(mirror: Served) -> None:
    prompt = "alpha beta STOP gamma delta"
    for stream in (False, True):
        kw = dict(model=mirror.model, prompt=prompt, max_tokens=20, temperature=0, stop=["STOP"])
        if stream:
            chunks = list(mirror.client().completions.create(stream=True, **kw))  # type: ignore[call-overload]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = mirror.client().completions.create(**kw)  # type: ignore[call-overload]
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == ("alpha beta ", "stop")
    assert mirror.wait_idle() == IDLE  # the engine side was aborted and freed


def test_stop_token_ids(mirror: Served) -> None:
    ids = mirror.post("/tokenize", json={"prompt": "one two three four"}).json()["tokens"]
    r = mirror.client().completions.create(
        model=mirror.model,
        prompt=ids,
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [ids[2]]},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens <= 3


def test_logprobs_shapes(mirror: Served) -> None:
    r = mirror.client().completions.create(
        model=mirror.model, prompt="log probs", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == 3 and "".join(lp.tokens) == r.choices[0].text
    assert all(isinstance(x, float) for x in lp.token_logprobs or [])
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    c = mirror.client().chat.completions.create(
        model=mirror.model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 2
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)


def test_models_health_tokenize_detokenize(mirror: Served) -> None:
    models = mirror.client().models.list()
    assert [m.id for m in models.data] == [mirror.model]
    assert models.data[0].model_extra == {"max_model_len": 4096}
    assert httpx.get(mirror.url + "/health").status_code == 200  # no key needed
    tok = mirror.post("/tokenize", json={"prompt": "héllo ☃"}).json()
    assert tok["max_model_len"] == 4096 and tok["count"] == len(tok["tokens"])
    detok = mirror.post("/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "héllo ☃"}


def test_server_info_schema_and_alias(mirror: Served) -> None:
    info = mirror.info()
    assert mirror.get("/get_server_info", "operator").json() == info
    assert info["engine"] == "kvfence"
    assert info["context_length"] == info["max_model_len"] == 4096
    assert info["max_req_input_len"] == 4096
    assert info["max_total_num_tokens"] == 512 * 16
    assert info["page_size"] == 16 and info["scrub_policy"] == "none"
    assert {p["role"] for p in info["pools"]} == {"prefill", "decode"}
    gate = info["capacity_gate"]
    assert gate["passed"] is True and gate["required_tokens"] == 5120
    assert gate["margin_tokens"] == 8192 - 5120 and "PASS" in gate["message"]
    assert info["undersized_pool"] is False and info["disaggregated"] is False
    assert info["prefix_cache"] == {"enabled": True, "namespacing": "tenant", "cache_salt": True}
    assert info["auth"] == "api-key"
    assert info["lab"] == {"faults": [], "profile": None}


def test_metrics_exposition(mirror: Served) -> None:
    before = mirror.metrics()
    mirror.client().completions.create(model=mirror.model, prompt="metrics", max_tokens=2)
    after = mirror.metrics()
    assert after["kvfence_requests_total{outcome=finished}"] == (
        before["kvfence_requests_total{outcome=finished}"] + 1
    )
    assert after["kvfence_prompt_tokens_total"] > before["kvfence_prompt_tokens_total"]
    assert after["kvfence_generation_tokens_total"] >= before["kvfence_generation_tokens_total"] + 2
    assert after["kvfence_http_responses_total{status=200}"] > 0
    assert after["kvfence_pool_pages{role=prefill,state=free}"] > 0
    assert after["kvfence_max_total_num_tokens"] == 8192
    assert after["kvfence_context_length"] == 4096
    for name in ("isolation_violations", "transfer_mismatches", "transfer_failures"):
        assert after[f"kvfence_{name}_total"] == 0
    assert "kvfence_prefix_cache_hit_tokens_total" in after


def test_auth_required_and_mapped_to_client_errors(mirror: Served) -> None:
    bad = openai.OpenAI(base_url=mirror.url + "/v1", api_key="sk-" + "0" * 32, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=mirror.model, prompt="x", max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    for path in ("/server_info", "/metrics", "/v1/models"):
        assert httpx.get(mirror.url + path).status_code == 401
    r = httpx.post(
        mirror.url + "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Basic " + mirror.key()},
    )
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


def test_unknown_model_is_404(mirror: Served) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        mirror.client().completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model"  # type: ignore[index]
