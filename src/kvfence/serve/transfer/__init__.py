"""KV transfer between prefill and decode: the `KVTransport` contract and its backends.

See `base.py` for the contract (and how NIXL / Mooncake would plug in) and
`registry.py` for picking a backend by name.
"""

from kvfence.serve.transfer.base import (
    Event,
    KVReceiver,
    KVSender,
    KVTransport,
    Landed,
    ManifestFields,
    TransferRefused,
)
from kvfence.serve.transfer.registry import (
    TransportRegistry,
    builtin_registry,
    get_transport,
    transport_names,
)

__all__ = [
    "Event",
    "KVReceiver",
    "KVSender",
    "KVTransport",
    "Landed",
    "ManifestFields",
    "TransferRefused",
    "TransportRegistry",
    "builtin_registry",
    "get_transport",
    "transport_names",
]
