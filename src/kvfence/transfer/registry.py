"""The transport registry: a name -> factory table, built fresh (no module-level state)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvfence.transfer.base import KVTransport
from kvfence.transfer.inprocess import InProcessTransport
from kvfence.transfer.mooncake import MooncakeTransport
from kvfence.transfer.nixl import NixlTransport
from kvfence.transfer.shm import ShmTransport
from kvfence.transfer.tcp import TcpTransport

TransportFactory = Callable[..., KVTransport]


class TransportRegistry:
    def __init__(self, factories: Mapping[str, TransportFactory] | None = None) -> None:
        self._factories: dict[str, TransportFactory] = dict(factories or {})

    def register_transport(self, name: str, factory: TransportFactory) -> None:
        """Add a backend (e.g. a NIXL or Mooncake one); a taken name raises."""
        if name in self._factories:
            raise ValueError(f"transport {name!r} is already registered")
        self._factories[name] = factory

    def get_transport(self, name: str, **options: Any) -> KVTransport:
        try:
            factory = self._factories[name]
        except KeyError:
            raise ValueError(
                f"unknown KV transport {name!r}; known: {', '.join(self.names())}"
            ) from None
        return factory(**options)

    def names(self) -> list[str]:
        return sorted(self._factories)


def builtin_registry() -> TransportRegistry:
    return TransportRegistry(
        {
            InProcessTransport.name: InProcessTransport,
            TcpTransport.name: TcpTransport,
            ShmTransport.name: ShmTransport,
            # Real transfer engines (the `pd` extra; imported when first used).
            MooncakeTransport.name: MooncakeTransport,
            NixlTransport.name: NixlTransport,
        }
    )


def get_transport(name: str, **options: Any) -> KVTransport:
    """A built-in transport by name: "inprocess", "tcp", "shm", "mooncake" or "nixl"."""
    return builtin_registry().get_transport(name, **options)


def transport_names() -> list[str]:
    return builtin_registry().names()
