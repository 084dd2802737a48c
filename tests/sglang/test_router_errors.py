"""sglang-router's refusals (bodies seen live from 0.3.2) become kvfence's error envelope."""

from __future__ import annotations

from kvfence.sglang_stack.router_errors import conform, named_field, refusal, unreadable

CUT_STREAM_REFUSAL = (
    b'data: {\'error\': {"message":{"error":{"message":"prompt (73 tokens) + max_tokens '
    b"(400) = 473 exceeds this server's limit of 336 tokens per request (max_req_input_len)\","
    b'"type":"invalid_request_error","param":"max_tokens","code"'
)


def test_a_refused_stream_keeps_the_worker_fields_that_arrived_whole() -> None:
    err = refusal(CUT_STREAM_REFUSAL)["error"]
    assert err["param"] == "max_tokens" and err["message"].startswith("prompt (73 tokens)")
    assert err["type"] == "invalid_request_error" and err["code"] is None
    assert refusal(b"data: garbage\n\n")["error"]["message"].startswith("the router refused")


def test_the_routers_422_is_a_400_naming_the_field() -> None:
    missing = unreadable(b"Failed to deserialize the JSON body into the target type: missing "
                         b"field `model` at line 1 column 15")  # fmt: skip
    assert (missing.status, missing.param, missing.code) == (400, "model", "invalid_value")
    variant = unreadable(b"Failed to deserialize the JSON body into the target type: prompt: "
                         b"data did not match any variant of untagged enum StringOrArray")  # fmt: skip
    assert variant.param == "prompt"
    assert unreadable(b"something else").code == "invalid_json"


def test_the_routers_own_shapes_are_rebuilt_and_kvfences_kept() -> None:
    own = b'{"error":{"code":400,"message":"messages: Validation error: empty","type":"x"}}'
    err = conform(400, own, ("model", "messages"))
    assert err == {"error": {"message": "messages: Validation error: empty",
                             "type": "invalid_request_error", "param": "messages", "code": None}}  # fmt: skip
    rewritten = b'{"error":{"type":"Bad Request","code":"decode_bad_request","message":"prompt (9'
    rewritten += b' tokens) + max_tokens (400) = 409 exceeds"}}'
    chat = conform(400, rewritten, ("messages", "max_completion_tokens"))
    assert chat is not None and chat["error"]["param"] == "messages"
    assert chat["error"]["code"] == "decode_bad_request"  # its words name no worker code
    whole = rewritten.replace(b"exceeds", b"exceeds this server's limit of 336 tokens per request "
                              b"(max_req_input_len)")  # fmt: skip
    assert conform(400, whole, ("messages",))["error"]["code"] == "context_length_exceeded"
    pool = whole.replace(b'len)"', b'len); its KV pool (336) is smaller than the context (512)"')
    assert conform(400, pool, ("messages",))["error"]["code"] == "pool_capacity_exceeded"
    kept = b'{"error":{"message":"m","type":"invalid_request_error","param":"top_k","code":null}}'
    assert conform(400, kept, ("top_k",)) is None
    plain = conform(503, b"No available workers", ())
    assert plain == {"error": {"message": "No available workers", "type": "server_error",
                               "param": None, "code": None}}  # fmt: skip


def test_a_field_is_named_by_backticks_first_then_by_the_body() -> None:
    assert named_field("`temperature` must be at most 2", ("model",)) == "temperature"
    assert named_field("no field here", ("model",)) is None
    assert named_field("top_p and top_k", ("top_k", "top_p")) == "top_p"
