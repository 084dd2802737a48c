from __future__ import annotations

from pathlib import Path

import pytest

from kvfence.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def sgl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sgl-ckpt") / "tiny", seed=0)
