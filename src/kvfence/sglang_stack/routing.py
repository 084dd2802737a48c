"""A worker's request path behind SGLang's router: the router's room, bound to the tenant.

Same admission as kvfence's own edge (auth, strict fields, limits; nothing
allocated before it passes), with the router's fields taken apart first
(`fields.py`). The room is the router's `bootstrap_room`, claimed for the
authenticated tenant (a room in use is a 409, I9). When this worker refuses a
routed request, the refusal goes to the other worker of the pair through the
bootstrap channel with the original error (`PairedBackend.reject`), so a
decode that reserved pages for it releases them and answers the same error
instead of waiting for KV that will not come (the incident's reject path).

Only the lab's `decode-trusts-bootstrap` switch lets a decode worker take a
client's bootstrap fields off the router's path: the defect of a PD worker that
serves whoever names a room.
"""

from __future__ import annotations

from typing import Protocol, cast

from starlette.requests import Request

from kvfence.engine.backend import Backend
from kvfence.engine.messages import ErrorInfo
from kvfence.faults import Fault, FaultSet
from kvfence.serve import protocol
from kvfence.serve.errors import ApiError
from kvfence.serve.fields import load_json
from kvfence.serve.protocol import Kind
from kvfence.serve.router import Router, Run
from kvfence.sglang_stack.fields import (
    BOOTSTRAP_FIELDS,
    RoomBinding,
    direct_refused,
    split_router_fields,
)
from kvfence.sglang_stack.gate import VIA_ROUTER


class PairedBackend(Backend, Protocol):
    """A backend that is one half of a prefill/decode pair."""

    role: str

    def reject(self, binding: RoomBinding, error: ErrorInfo) -> None:
        """This worker refused the room: tell the other half at once, with the original error."""


class WorkerRouter(Router):
    """`Router` whose rooms come from SGLang's router (authenticated by its path)."""

    def _admit_and_submit(self, kind: Kind, tenant: str, body: bytes, request: Request) -> Run:
        backend = cast(PairedBackend, self.backend)
        raw = load_json(body)
        via_router = bool(request.scope.get(VIA_ROUTER))
        trusted = via_router or trusts_client_room(raw, backend.role, self.config.faults)
        obj, binding = split_router_fields(raw, kind, trusted)
        if binding is None:
            raise direct_refused(backend.role)
        try:
            req = protocol.parse_chat(obj) if kind == "chat" else protocol.parse_completion(obj)
            prep = self.admission.prepare(req, tenant)
            room = self.claim_room(binding.room, tenant)
        except ApiError as e:
            backend.reject(binding, _info(e))
            raise
        try:
            slot = self.admission.limits.acquire(tenant, len(prep.prompt_ids))
        except ApiError as e:
            self.rooms.pop(room, None)
            backend.reject(binding, _info(e))
            raise
        try:
            run = self.submit(prep, room, binding.peer)
        except BaseException:
            slot.release()
            self.rooms.pop(room, None)
            raise
        run.slot = slot
        return run


def trusts_client_room(obj: object, role: str, faults: FaultSet) -> bool:
    """Lab only: a decode worker that takes a client's bootstrap fields as the router's."""
    if Fault.DECODE_TRUSTS_BOOTSTRAP not in faults or role != "decode":
        return False
    return isinstance(obj, dict) and any(name in obj for name in BOOTSTRAP_FIELDS)


def _info(e: ApiError) -> ErrorInfo:
    return ErrorInfo(e.status, e.type, e.message, e.param, e.code)
