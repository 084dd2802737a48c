from __future__ import annotations

from pathlib import Path

import pytest

from kvfence.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny checkpoint (a real transformer, head dim 32), written once."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("watch-ckpt") / "tiny", seed=0)
