"""Session-wide test settings."""

from __future__ import annotations

import os

import pytest
import torch

# The servers tests start share the cores with pytest and with each other: every OpenMP wait
# sleeps there, as under `kvfence audit` (cli.set_openmp_waits); a lone `kvfence serve` would
# spin briefly. Set before any server starts, and inherited by each.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config: pytest.Config) -> None:
    # The suite runs servers, engine threads and clients in one process on a 2-core runner:
    # torch's intra-op threads would spin against them (measured 3-10x slower). Worker
    # processes started by tests get --torch-threads 1 for the same reason.
    torch.set_num_threads(1)
