"""The fields SGLang's router writes into a request body, taken apart before the strict parser.

Seen live (sglang-router 0.3.2, PD mode, loopback): the router re-serialises
every body through its own types and sends the same body to one prefill and
one decode worker, with `bootstrap_host` (the prefill URL's host),
`bootstrap_port` and `bootstrap_room` (random, 63-bit; a client's own room is
overwritten) added, and a fixed set of SGLang options written with their
defaults (`ROUTER_DEFAULTS`). It forwards a client's `rid` unchanged.

I9: rooms and request ids are made by a server, never taken from a client.
So `rid` is refused everywhere, and the bootstrap fields are honoured only on
the router's authenticated path (`gate.py`); on any other path they are a 400
that names the field (only the lab's `decode-trusts-bootstrap` switch lets a
decode worker take them from a client, routing.py). The SGLang options kvfence
does not implement are accepted only at the value the router writes when the
client gave none; any other value is a 400 (never a field accepted and ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfence.serve.errors import ApiError, bad_request
from kvfence.serve.protocol import Kind

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
ROOM_BITS = 63  # the router draws rooms below 2**63
ROUTER_DEFAULTS: dict[str, dict[str, object]] = {
    "completion": {
        "echo": False,
        "no_stop_trim": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    },
    "chat": {
        "no_stop_trim": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
    },
}


@dataclass(frozen=True, slots=True)
class RoomBinding:
    """The room the router assigned and the prefill bootstrap it assigned it to."""

    room: str
    host: str
    port: int

    @property
    def peer(self) -> str:
        """Prefill's bootstrap channel (ZeroMQ) for this room."""
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{shown}:{self.port}"


def split_router_fields(
    obj: dict[str, Any], kind: Kind, via_router: bool
) -> tuple[dict[str, Any], RoomBinding | None]:
    """The body the strict parser sees, and the router's room (None off the router's path)."""
    if "rid" in obj:
        raise bad_request(
            "`rid` is not accepted: request ids are made by the server, never taken from a "
            "client (I9)",
            "rid",
        )
    if not via_router:
        for name in BOOTSTRAP_FIELDS:
            if name in obj:
                raise bad_request(
                    f"`{name}` is set only by the PD router, which authenticates with its router "
                    "credential; a client may not send it (I9)",
                    name,
                )
        return obj, None
    rest = dict(obj)
    binding = RoomBinding(
        room=str(_integer(rest.pop("bootstrap_room", None), "bootstrap_room", 2**ROOM_BITS - 1)),
        host=_host(rest.pop("bootstrap_host", None)),
        port=_integer(rest.pop("bootstrap_port", None), "bootstrap_port", 65535, low=1),
    )
    for name, default in ROUTER_DEFAULTS[kind].items():
        if name in rest:
            value = rest.pop(name)
            if type(value) is not type(default) or value != default:
                raise bad_request(
                    f"`{name}` = {value!r} is not supported by kvfence (only the router's "
                    f"default, {default!r})",
                    name,
                )
    return rest, binding


def _integer(value: Any, name: str, high: int, *, low: int = 0) -> int:
    if value is None:
        raise bad_request(f"`{name}` is required on the PD router's path", name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(f"`{name}` must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def _host(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request("`bootstrap_host` is required on the PD router's path", "bootstrap_host")
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:")
    if len(value) > 253 or not set(value) <= allowed:
        raise bad_request(
            "`bootstrap_host` must be a host name or an IP address (at most 253 characters)",
            "bootstrap_host",
        )
    return value


def direct_refused(role: str) -> ApiError:
    """A generation request that reached a PD worker off the router's path."""
    return ApiError(
        400,
        f"this is a kvfence {role} worker of a prefill/decode pair: it serves generation only "
        "through the PD router (send the request to the router's URL)",
        code="pd_worker_direct",
    )
