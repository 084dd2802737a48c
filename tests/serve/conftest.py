from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import Served, serve

from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.build import PoolSizes


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve-ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def mirror(checkpoint: Path) -> Iterator[Served]:
    """The mirror model (echoes what it attends to), four tenants, small pools."""
    with serve(
        checkpoint, kind="mirror", pools=PoolSizes(prefill_pages=512, decode_pages=512)
    ) as s:
        yield s


@pytest.fixture(scope="module")
def llama(checkpoint: Path) -> Iterator[Served]:
    with serve(checkpoint, kind="llama", pools=PoolSizes(prefill_pages=512, decode_pages=512)) as s:
        yield s
