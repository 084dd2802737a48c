"""Start-up of a serving process: ready sooner, serving exactly what it served before.

A server's start-up is mostly imports (torch, the web stack) and building the
model. Two process-level settings make that shorter without changing what the
process does once it serves (bench/serve_ready.py measures them):

- `collector_paused()`: the cyclic garbage collector is off while the role
  imports and builds. Those steps create a few hundred thousand objects that
  live as long as the process; each collection pass the allocations trigger
  walks them and frees nothing (about an eighth of `import torch`). On the
  way out the survivors are frozen (`gc.freeze`: moved to a generation the
  collector no longer walks) and the collector resumes: a full collection over
  them would otherwise stall the serving threads for ~0.1 s now and then.
  Start-up garbage in a cycle stays allocated for good: a bounded, one-time cost.
- `quiet_torch_import()`: `TORCH_DEVICE_BACKEND_AUTOLOAD=0` unless the user set
  it. kvfence runs its models on the CPU; the setting only skips torch's scan of
  every installed package for out-of-tree device plugins at import.

Readiness is not touched: /health still answers 200 only once the model is
built, the gate (I4) has passed and the server listens.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Collector off for the block; then freeze what survived and restore the collector."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def quiet_torch_import() -> None:
    """Skip torch's device-plugin scan at import (it must run before torch is imported)."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def set_torch_threads(n: int) -> None:
    """Intra-op threads for a worker's model; 0 keeps torch's default."""
    if n:
        import torch  # torch: workers only

        torch.set_num_threads(n)
