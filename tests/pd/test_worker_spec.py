"""A worker's spec crosses the process boundary whole and is validated on receipt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfence.serve.specs import (
    SPEC_VERSION,
    SpecError,
    WorkerSpec,
    decode_spec,
    encode_spec,
    read_spec,
    write_spec,
)

SPEC = WorkerSpec(
    role="decode",
    model_dir="/models/m",
    model_kind="mirror",
    inbox="tcp://127.0.0.1:7001",
    router_addr="tcp://127.0.0.1:7000",
    kv_pages=512,
    faults=("early-free",),
    transport="shm",
    torch_threads=1,
)


def _doc(**body: object) -> str:
    obj = json.loads(encode_spec(SPEC))
    obj["body"].update(body)
    return json.dumps(obj)


def test_a_spec_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "decode-0.json"
    write_spec(SPEC, path)
    assert read_spec(WorkerSpec, path) == SPEC
    assert path.stat().st_mode & 0o077 == 0  # the owner's only


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("{not json", "not a JSON worker spec"),
        (json.dumps({"type": "kvfence.WorkerSpec", "body": {}}), "exactly 'type', 'version'"),
        (encode_spec(SPEC).replace(f'"version": {SPEC_VERSION}', '"version": 9'), "version 9"),
        (_doc(pagez=3), "unknown fields ['pagez']"),
        (_doc(kv_pages="512"), "WorkerSpec.kv_pages"),
        (_doc(faults="early-free"), "WorkerSpec.faults must be a list"),
        (_doc(role="router"), "a worker role is 'prefill' or 'decode'"),
        (_doc(transport="inprocess"), "a cross-process transport is one of"),
        (_doc(torch_threads=-1), "torch_threads must be >= 0"),
    ],
)
def test_a_bad_spec_is_refused_with_the_reason(raw: str, why: str) -> None:
    with pytest.raises(SpecError) as e:
        decode_spec(WorkerSpec, raw)
    assert why in str(e.value)


def test_a_missing_field_is_refused() -> None:
    obj = json.loads(encode_spec(SPEC))
    del obj["body"]["inbox"]
    with pytest.raises(SpecError, match="inbox"):
        decode_spec(WorkerSpec, json.dumps(obj))


def test_the_worker_entry_exits_2_on_a_bad_spec_before_loading_a_model(tmp_path: Path) -> None:
    path = tmp_path / "prefill-0.json"
    path.write_text(_doc(role="nobody"))
    out = subprocess.run(
        [sys.executable, "-m", "kvfence.hub.worker_entry", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "bad worker spec" in out.stderr and "'nobody'" in out.stderr


def test_the_worker_group_exits_2_on_any_bad_spec_before_it_forks(tmp_path: Path) -> None:
    good, bad = tmp_path / "prefill-0.json", tmp_path / "decode-0.json"
    good.write_text(encode_spec(SPEC))
    bad.write_text(_doc(role="nobody"))
    out = subprocess.run(
        [sys.executable, "-m", "kvfence.hub.worker_group", str(good), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "kvfence worker group:" in out.stderr and "'nobody'" in out.stderr
    assert "exited with code" not in out.stderr  # no worker was started
