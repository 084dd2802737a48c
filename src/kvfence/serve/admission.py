"""Admission: everything the edge refuses, before the backend sees a request.

Synchronous and network-free: `authenticate` maps the `Authorization` header
to a tenant (before the body is read), and `admit` turns the raw body into a
`Prepared` request, or either raises `ApiError` (a 4xx that names the field
and the limit). Nothing here allocates, so a refused request leaves
no trace in any pool (I4: the edge limit on prompt + max_tokens is enforced
here; I8: the prefix-cache namespace is decided here; I10: the key → tenant
lookup is constant-time in `TenantRegistry`).

This is the seam for new admission rules (an operator credential, per-tenant
limits, ...): a credential belongs in `authenticate`, a limit in `admit` or
`prepare`; the router only calls these two and submits what `admit` returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfence.engine.messages import MessageError, SamplingParams
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve import protocol
from kvfence.serve.body import BODY_FLOOR as BODY_FLOOR  # re-exported for the sglang stack
from kvfence.serve.body import body_limit_for
from kvfence.serve.config import Capacity, ServeConfig
from kvfence.serve.errors import ApiError, bad_request
from kvfence.serve.fields import load_json
from kvfence.serve.limits import AdmissionLimits, default_limits
from kvfence.serve.protocol import GenerationRequest, Kind
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.tokenizing import (
    INLINE_BYTES,
    Encoded,
    TokenizerPool,
    encode_once,
    encoded_ahead,
)

# Unicode normalization (NFC, NFKC) can fold up to 3 code points into one (Hangul jamo,
# stacked diacritics) before the tokenizer sees them: room for 4 keeps the bound an upper one.
CHARS_FOLDED = 4
# Some tokenizers map a whole overlong word to one unknown token (WordPiece: 100 characters).
MIN_TOKEN_CHARS = 128


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token covers (its vocabulary string's length:
    byte-level vocabularies spell a token with one character per byte, and a character is at
    least a byte)."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(MIN_TOKEN_CHARS, max((len(t) for t in vocab), default=0))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request that passed every check and may be submitted."""

    req: GenerationRequest
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_namespace: str


class Admission:
    """Auth, model check, token-id and length limits, cache namespace, chat encoding."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: ServeConfig,
        capacity: Capacity,
        tenants: TenantRegistry,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.capacity = capacity
        self.tenants = tenants
        self.limits = AdmissionLimits(tenants.limits(), default_limits(capacity))
        self.pool = TokenizerPool()
        # A text longer than this cannot fit the context whatever it holds: refused before
        # tokenizing, so neither the time nor the ids' memory grows with a huge prompt.
        self.prompt_char_limit = (
            config.context_length * longest_token_chars(tokenizer) * CHARS_FOLDED
        )

    @property
    def body_limit(self) -> int:
        """The largest request body read, in bytes (413 above it)."""
        return body_limit_for(self.config.context_length)

    async def encode_ahead(self, kind: Kind, body: bytes) -> Mapping[str, Encoded]:
        """The texts this body's prompt will need, encoded in the bounded pool (off the loop)
        when the body is large; `tokenizing.encodings` hands them to `admit`/`prepare`."""
        if len(body) <= INLINE_BYTES:
            return {}  # tokenized inline by `admit`: cheaper than a thread hop
        return await self.pool.run(len(body), lambda: self._texts_encoded(kind, body))

    def _texts_encoded(self, kind: Kind, body: bytes) -> Mapping[str, Encoded]:
        """Best effort: anything refused here is refused again, cheaply, by the real parse
        (fields another layer strips first, such as a router's, are left out)."""
        try:
            obj: dict[str, Any] = load_json(body)
            if kind == "chat":
                known = {k: v for k, v in obj.items() if k in protocol.CHAT_FIELDS}
                messages = protocol.parse_chat(known).prompt
                assert isinstance(messages, tuple)
                text = self._chat_text(
                    tuple(m for m in messages if isinstance(m, protocol.ChatMessage))
                )
            elif isinstance(obj.get("prompt"), str):
                text = obj["prompt"]
            else:
                return {}
            if len(text) > self.prompt_char_limit:
                return {}  # refused by the real parse before it looks at any encoding
            return {text: self._encode(text, "messages" if kind == "chat" else "prompt")}
        except ApiError:
            return {}

    def admit(self, kind: Kind, tenant: str, body: bytes) -> Prepared:
        """An authenticated tenant's generation request, from raw body to `Prepared`."""
        obj = load_json(body)
        req = protocol.parse_chat(obj) if kind == "chat" else protocol.parse_completion(obj)
        return self.prepare(req, tenant)

    def authenticate(self, authorization: str | None) -> str:
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            raise ApiError(
                401,
                "missing or invalid API key; send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )
        return tenant

    def viewer(self, authorization: str | None) -> str | None:
        """Who reads operator-or-tenant data: None for the operator, else the tenant (401 if neither)."""
        if self.tenants.is_operator(authorization):
            return None
        return self.authenticate(authorization)

    def authorize_operator(self, authorization: str | None, what: str) -> None:
        """Operator data (I10): 401 without a valid key, 403 for a tenant key."""
        if self.viewer(authorization) is not None:
            raise ApiError(
                403,
                f"{what} is operator data (other tenants' activity); send an operator key "
                "(kvfence serve --operator-key, or operator_keys in the tenants file)",
                type="permission_error",
                code="operator_only",
            )

    def prepare(self, req: GenerationRequest, tenant: str) -> Prepared:
        """Tokenize and check everything; raises `ApiError`, never touches the backend."""
        self.check_model(req.model)
        ids, param = self._prompt_ids(req)
        self.check_ids(ids, param)
        self.check_ids(req.stop_token_ids, "stop_token_ids")
        max_tokens = self._max_tokens(len(ids), req.max_tokens, param)
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=req.logprobs,
            )
        except MessageError as e:
            raise bad_request(str(e), None) from None
        return Prepared(req, tenant, ids, sampling, self.cache_namespace(tenant, req.cache_salt))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def cache_namespace(self, tenant: str, salt: str | None) -> str:
        """The prefix-cache namespace (I8): the tenant's own, split further by `cache_salt`."""
        shared = self.config.prefix_namespacing == "shared"
        base = "shared" if shared else f"tenant:{tenant}"
        if salt is None:
            return base
        return f"{base}/salt:{hashlib.sha256(salt.encode()).hexdigest()[:32]}"

    def encode_chat(
        self, messages: tuple[protocol.ChatMessage, ...], *, whole: bool = False
    ) -> list[int]:
        return list(self.encode_text(self._chat_text(messages), "messages", whole=whole))

    def _chat_text(self, messages: tuple[protocol.ChatMessage, ...]) -> str:
        chars = sum(len(m.content) for m in messages)
        if chars > self.prompt_char_limit:  # before the template copies them all
            raise self._too_many_chars("messages", chars)
        try:
            return self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages]
            )
        except Exception as e:  # jinja raises many kinds; any of them is a bad conversation
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None

    def encode_text(self, text: str, param: str, *, whole: bool = False) -> tuple[int, ...]:
        """`text`'s ids (encoded ahead by this request, or now); over the character bound: 400.
        Over the context a 400 too, unless `whole` (/tokenize counts any text it is sent)."""
        if len(text) > self.prompt_char_limit:
            raise self._too_many_chars(param, len(text))
        if whole:
            return tuple(encode_once(self.tokenizer, text).ids)
        ahead = encoded_ahead(text)
        encoded = ahead if ahead is not None else self._encode(text, param)
        if isinstance(encoded, ApiError):
            raise encoded
        return encoded

    def _encode(self, text: str, param: str) -> Encoded:
        """The ids, or the refusal of a text over the context (from the count alone: a refused
        prompt's ids are never built, which for a ~1 MB prompt is a million Python ints)."""
        encoding = encode_once(self.tokenizer, text)
        if len(encoding) > self.config.context_length:
            return self._too_many_tokens(param, len(encoding))
        return tuple(encoding.ids)

    def _too_many_tokens(self, param: str, n: int) -> ApiError:
        ctx = self.config.context_length
        return bad_request(
            f"`{param}` has {n} tokens; this model's maximum context length is {ctx} tokens",
            param,
            "context_length_exceeded",
        )

    def _too_many_chars(self, param: str, chars: int) -> ApiError:
        ctx = self.config.context_length
        return bad_request(
            f"`{param}` has {chars} characters; no text over {self.prompt_char_limit} "
            f"characters fits this model's maximum context length of {ctx} tokens",
            param,
            "context_length_exceeded",
        )

    def check_ids(self, ids: tuple[int, ...], param: str) -> None:
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"`{param}` holds token id {bad}, outside the vocabulary [0, {vocab})",
                param,
                "token_out_of_vocab",
            )

    def _prompt_ids(self, req: GenerationRequest) -> tuple[tuple[int, ...], str]:
        if req.kind == "chat":
            assert isinstance(req.prompt, tuple)
            messages = tuple(m for m in req.prompt if isinstance(m, protocol.ChatMessage))
            return tuple(self.encode_chat(messages)), "messages"
        if isinstance(req.prompt, str):
            return self.encode_text(req.prompt, "prompt"), "prompt"
        return tuple(t for t in req.prompt if isinstance(t, int)), "prompt"

    def _max_tokens(self, n: int, asked: int | None, param: str) -> int:
        ctx, edge = self.config.context_length, self.capacity.edge_limit
        if n == 0:
            raise bad_request(f"`{param}` is empty; send at least one token", param, "empty_prompt")
        if n > ctx:
            raise self._too_many_tokens(param, n)
        # I4: with an undersized pool the edge is the pool, and it is enforced here,
        # before the backend sees anything.
        limit_name = "pool_capacity_exceeded" if edge < ctx else "context_length_exceeded"
        default = max(1, min(self.config.default_max_tokens, edge - n))
        max_tokens = asked if asked is not None else default
        if n + max_tokens > edge:
            why = (
                f"; its KV pool ({edge}) is smaller than the context ({ctx})" if edge < ctx else ""
            )
            raise bad_request(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"this server's limit of {edge} tokens per request (max_req_input_len){why}",
                param if n >= edge else "max_tokens",
                limit_name,
            )
        return max_tokens
