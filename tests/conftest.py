"""Session-wide test settings."""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # The suite runs servers, engine threads and clients in one process on a 2-core runner:
    # torch's intra-op threads would spin against them (measured 3-10x slower). Worker
    # processes started by tests get --torch-threads 1 for the same reason.
    torch.set_num_threads(1)
