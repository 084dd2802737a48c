"""Every engine fixture says where its shape comes from (version + source file).

A fixture without provenance is how invented fields crept in before: each
file under fixtures/<engine>/ must be named in that folder's README.md,
which names the engine version and the source it was written from (or that
it was captured live).
"""

from __future__ import annotations

import json
import re

import pytest
from audit_replay import FIXTURES

ENGINES = ("sglang", "vllm", "tgi", "llamacpp")


@pytest.mark.parametrize("engine", ENGINES)
def test_every_fixture_is_named_in_its_provenance_note(engine: str) -> None:
    folder = FIXTURES / engine
    note = (folder / "README.md").read_text()
    files = sorted(p.name for p in folder.iterdir() if p.name != "README.md")
    assert files
    listed = set(re.findall(r"`([^`]+\.(?:json|txt))`", note))
    globs = [re.compile(g.replace(".", r"\.").replace("*", ".*")) for g in listed if "*" in g]
    missing = [f for f in files if f not in listed and not any(g.fullmatch(f) for g in globs)]
    assert missing == []
    for name in files:
        if name.endswith(".json"):
            json.loads((folder / name).read_text())  # well-formed
