from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvfence.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (seed 0), written once per test session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny matmuls: on a shared 2-core runner, two OpenMP threads spin and run ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
