"""KV transfer between prefill and decode: the `KVTransport` contract and its backends.

See `base.py` for the contract (and how NIXL / Mooncake would plug in) and
`registry.py` for picking a backend by name.
"""

from kvfence.transfer.base import KVReceiver, KVSender, KVTransport, TransferRefused
from kvfence.transfer.registry import (
    TransportRegistry,
    builtin_registry,
    get_transport,
    transport_names,
)
from kvfence.transfer.rooms import Event, Landed

__all__ = [
    "Event",
    "KVReceiver",
    "KVSender",
    "KVTransport",
    "Landed",
    "TransferRefused",
    "TransportRegistry",
    "builtin_registry",
    "get_transport",
    "transport_names",
]
