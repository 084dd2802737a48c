"""Whether a transport's native transfer engine loads here, and what to do when it does not.

Mooncake and NIXL are imported when a worker first moves KV, in the worker's own process:
a missing wheel or system library (Mooncake's `libibverbs`) would surface there as an
ImportError in a worker's log, after the stack had started. The CLI asks here first, in
its own process, and stops with one line naming the fix.
"""

from __future__ import annotations

import importlib
from typing import Final

# transport -> (the module that loads its native engine, how to install it)
NATIVE: Final[dict[str, tuple[str, str]]] = {
    "mooncake": (
        "mooncake.engine",
        "`make pd` (the `pd` extra and Debian's libibverbs1: apt-get install libibverbs1)",
    ),
    "nixl": ("nixl_cu12", "`make pd` (nixl-cu12, installed with --no-deps)"),
}


def missing_native(transport: str) -> str | None:
    """None when `transport` needs no native engine or its engine loads; else a message that
    names what failed and the fix, and the transport that needs nothing."""
    if transport not in NATIVE:
        return None
    module, install = NATIVE[transport]
    try:
        importlib.import_module(module)
    except (ImportError, OSError) as e:
        return (
            f"--transport {transport} needs its transfer engine, which cannot load here "
            f"({module}: {e}); install it with {install}, or choose --transport tcp"
        )
    return None
