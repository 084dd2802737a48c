"""Typed messages between the roles (router, prefill, decode).

Every message that crosses a role boundary is one of these frozen dataclasses,
whether the roles share a process (in-process queues) or not (ZeroMQ). Each
carries `version`; `decode_message` validates type, version and every field
on receipt and raises `MessageError` for anything malformed or unexpected, so
a worker can log and refuse it instead of crashing.

The PD protocol (one request):
  router  -> decode : Bootstrap        decode reserves pages for exactly the prompt
  decode  -> router : BootstrapReady   the destination page handles (index, generation)
  router  -> prefill: PrefillWork      prompt + destination handles
  prefill -> decode : TransferManifest (with the KV payload, over a KVTransport)
  decode  -> router : TokenChunk ...   streamed tokens, the last one with finish_reason
  any     -> router : Failure          the original error; the request ends with it
  router  -> any    : Abort            client gone / rejected: stop and release (deferred, I7)

Behind SGLang's router (sglang_stack/), both workers get the request; decode
registers its reservation at prefill's bootstrap port instead of the router
relaying it:
  decode  -> prefill: RoomRegistration the router's room, the tenant decode authenticated,
                                       the reserved handles and where to write them
  prefill -> decode : Failure / Abort / TransferDone, straight back on that channel
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvfence.engine.counters import Counters

T = TypeVar("T")

PROTOCOL_VERSION = 2  # 2: WorkerStatus carries its counts as one nested `Counters`


class MessageError(ValueError):
    """A message that is malformed, of an unknown type or version, or has a bad field."""


# The engine's own bounds on sampling. Each is what the engine can run at all (the
# sampler's tensors are int64 / float32), so a value outside them never enters a step,
# whoever built the params: the HTTP edge (which may be stricter), a worker decoding a
# message, a test. The edge reuses these numbers so its 400s name the same limits.
MAX_INT64 = 2**63 - 1
MAX_TOP_K = 2**31 - 1  # beyond any vocabulary: every value above the vocab size means "off"
MAX_GEN_TOKENS = 2**31 - 1  # the context window caps it far earlier; this only keeps it finite
MAX_LOGPROBS = 20
MAX_SAMPLING_TEMPERATURE = 100.0
SEED_RANGE = (0, MAX_INT64)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs to return per token, None = off

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_GEN_TOKENS:
            raise MessageError(
                f"max_tokens must be in [1, {MAX_GEN_TOKENS}], got {self.max_tokens}"
            )
        # `not lo <= x <= hi` also refuses NaN.
        if not 0.0 <= self.temperature <= MAX_SAMPLING_TEMPERATURE:
            raise MessageError(
                f"temperature must be in [0, {MAX_SAMPLING_TEMPERATURE:g}], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise MessageError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise MessageError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")
        lo, hi = SEED_RANGE
        if self.seed is not None and not lo <= self.seed <= hi:
            raise MessageError(f"seed must be in [{lo}, {hi}], got {self.seed}")
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= MAX_INT64), None)
        if bad is not None:
            raise MessageError(f"stop_token_ids must be in [0, {MAX_INT64}], got {bad}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MessageError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """The original error (mirrors engine.request.RequestError across the wire)."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class PageRef:
    index: int
    generation: int


@dataclass(frozen=True, slots=True)
class Bootstrap:
    room: str
    tenant: str
    num_prompt_tokens: int
    max_tokens: int
    # Decode samples every token after the first, so it needs the request's sampling.
    sampling: SamplingParams = SamplingParams()
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class BootstrapReady:
    room: str
    pages: tuple[PageRef, ...]
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class PrefillWork:
    room: str
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    dest_pages: tuple[PageRef, ...]
    cache_namespace: str  # tenant (+ cache_salt) prefix-cache namespace (I8)
    decode_addr: str = ""  # where the KV goes; empty in single-process mode
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class TransferManifest:
    """What prefill says it sent. Decode checks every field against its reservation (I3)."""

    room: str
    tenant: str
    num_tokens: int
    num_pages: int
    dest_pages: tuple[PageRef, ...]
    checksum: str
    first_token: int
    first_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int = 0
    prefill_s: float = 0.0  # engine-side prefill time (signal 3); 0.0 when not measured
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class TokenChunk:
    room: str
    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    finish_reason: str | None = None
    cached_tokens: int = 0
    prefill_s: float = 0.0  # set on a request's first chunk: its prefill time on the engine
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Failure:
    room: str
    error: ErrorInfo
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Abort:
    room: str
    reason: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Queued:
    """Prefill holds this paired room (queued or in its engine) and will transfer or fail it.

    Sent at pairing and then periodically while the room lives, so decode's wait follows
    prefill: a room behind a long prefill queue keeps its place, and a prefill that stops
    sending (it died, or lost the room) is given up one wait after its last word.
    """

    room: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class TransferDone:
    """The transport's confirmation that nothing more will land in these pages (I7)."""

    room: str
    ok: bool
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker's live facts, sent at start-up and then periodically to the router.

    The router's capacity gate (I4) and /server_info read the pools from these,
    i.e. from the running workers, never from a config file.
    """

    role: str  # "prefill" or "decode"
    worker: str  # the worker's control inbox address (its identity)
    kv_address: str  # decode: where KV senders connect; prefill: ""
    pool_tokens: int
    page_size: int
    pages_used: int
    pages_free: int
    pages_pending: int
    counters: Counters = field(default_factory=Counters)  # this worker's role's counts
    # "ok" when the worker was quiet and its ledger passed check_integrity(); the
    # AssertionError text when it did not; "" when busy (not checked this time).
    integrity: str = ""
    refused_messages: int = 0  # malformed or unexpected control messages the inbox refused
    pages_cached: int = 0  # of pages_used: evictable prefix-cache pages (PoolInfo.pages_cached)
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class RoomRegistration:
    """Decode's reservation for a router-assigned room, sent to prefill's bootstrap port.

    Prefill pairs it with its own request for the same room and refuses the pair
    unless the tenants and prompt token counts agree (I9: a room is bound to the
    tenant both workers authenticated; I3 starts here).
    """

    room: str
    tenant: str
    num_prompt_tokens: int
    pages: tuple[PageRef, ...]
    kv_address: str  # decode's KV receiver
    reply_addr: str  # decode's bootstrap inbox: prefill's failures and notes go here
    version: int = PROTOCOL_VERSION


Message = (
    Bootstrap
    | BootstrapReady
    | PrefillWork
    | TransferManifest
    | TokenChunk
    | Failure
    | Abort
    | Queued
    | TransferDone
    | WorkerStatus
    | RoomRegistration
)
MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Bootstrap,
        BootstrapReady,
        PrefillWork,
        TransferManifest,
        TokenChunk,
        Failure,
        Abort,
        Queued,
        TransferDone,
        WorkerStatus,
        RoomRegistration,
    )
}
_NESTED: dict[str, type] = {
    "SamplingParams": SamplingParams,
    "ErrorInfo": ErrorInfo,
    "PageRef": PageRef,
    "Counters": Counters,
}


def encode_message(msg: Message) -> bytes:
    """JSON with the type name; tuples become lists and are restored by `decode_message`."""
    return json.dumps({"type": type(msg).__name__, "body": dataclasses.asdict(msg)}).encode()


def decode_message(raw: bytes) -> Message:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        # ValueError covers bad JSON, bad UTF-8 and over-long integer literals;
        # RecursionError a deeply nested payload. A peer must never crash a worker.
        raise MessageError(f"not a JSON message: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict) or set(obj) != {"type", "body"}:
        raise MessageError("a message is an object with exactly 'type' and 'body'")
    cls = MESSAGE_TYPES.get(obj["type"]) if isinstance(obj["type"], str) else None
    if cls is None:
        raise MessageError(f"unknown message type {obj['type']!r}")
    msg = _build(cls, obj["body"])
    if msg.version != PROTOCOL_VERSION:
        raise MessageError(f"{cls.__name__} version {msg.version} != supported {PROTOCOL_VERSION}")
    return typing.cast(Message, msg)


def build_checked(cls: type[T], body: Any) -> T:
    """A frozen dataclass of plain fields from its JSON body, with the message rules: unknown
    fields, wrong types and missing required fields raise `MessageError`. Used for other
    dataclasses that cross a process boundary (a worker's spec)."""
    return typing.cast(T, _build(cls, body))


def _build(cls: type, body: Any) -> Any:
    if not isinstance(body, dict):
        raise MessageError(f"{cls.__name__} body must be an object")
    fields = _fields_of(cls)
    unknown = set(body) - {name for name, _ in fields}
    if unknown:
        raise MessageError(f"{cls.__name__} has unknown fields {sorted(unknown)}")
    kwargs = {
        name: _coerce(hint, body[name], f"{cls.__name__}.{name}")
        for name, hint in fields
        if name in body
    }
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise MessageError(f"{cls.__name__}: {e}") from None


@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, Any], ...]:
    """Each field's name and resolved type hint, once per class: resolving the (string)
    annotations was a measurable part of the router's CPU when done for every message."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, where)
            except MessageError as e:
                errors.append(str(e))
        raise MessageError(f"{where}: {value!r} matches none of {options}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise MessageError(f"{where} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, where) for v in value)
        if len(args) != len(value):
            raise MessageError(f"{where} must have {len(args)} items")
        return tuple(_coerce(a, v, where) for a, v in zip(args, value, strict=True))
    if isinstance(hint, type) and hint.__name__ in _NESTED:
        return _build(hint, value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MessageError(f"{where} must be a number")
        try:
            return float(value)
        except OverflowError:
            raise MessageError(f"{where} is out of range for a float") from None
    if hint in (int, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise MessageError(f"{where} must be {hint.__name__}")
        return value
    raise MessageError(f"{where}: unsupported field type {hint}")
