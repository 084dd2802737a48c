from __future__ import annotations

import pytest
from runtime_helpers import Models


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("tiny-checkpoint"))
