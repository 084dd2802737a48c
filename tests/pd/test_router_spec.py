"""The router's spec crosses the process boundary whole, like a worker's, and is validated on
receipt; `--role router` and the `--disaggregated` supervisor build it by one function."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.hub.launch import Loopback, router_child
from kvfence.hub.router_entry import tenants_of
from kvfence.serve.specs import RouterSpec, SpecError, decode_spec, encode_spec, read_spec
from kvfence.serve.tenants import TenantRegistry

SPEC = RouterSpec(
    model_dir="/models/m",
    inbox="tcp://127.0.0.1:7000",
    prefill_addr=("tcp://127.0.0.1:7001",),
    decode_addr=("tcp://127.0.0.1:7002", "tcp://127.0.0.1:7003"),
    host="127.0.0.1",
    port=0,
    transport="shm",
    faults=("early-free",),
    request_log="/tmp/requests.jsonl",
    tenants_file="/etc/kvfence/tenants.json",
)
ADDRS = Loopback(SPEC.inbox, SPEC.prefill_addr, SPEC.decode_addr)


def _doc(**body: object) -> str:
    obj = json.loads(encode_spec(SPEC))
    obj["body"].update(body)
    return json.dumps(obj)


def test_the_supervisor_hands_the_router_its_spec_and_tenants_as_files(tmp_path: Path) -> None:
    tenants = TenantRegistry.generate(("a", "b"))
    child = router_child(SPEC, tenants, tmp_path)
    assert child.argv == (sys.executable, "-m", "kvfence.hub.router_entry", child.argv[-1])
    path = Path(child.argv[-1])
    got = read_spec(RouterSpec, path)
    assert got.tenants_file == str(tmp_path / "tenants.json") and not got.no_auth
    assert got == RouterSpec(**{**_fields(SPEC), "tenants_file": got.tenants_file})
    assert tenants_of(got) == tenants
    for f in (path, tmp_path / "tenants.json"):
        assert f.stat().st_mode & 0o077 == 0  # the owner's only: addresses and keys


def test_the_dev_registry_reaches_the_router_as_no_auth(tmp_path: Path) -> None:
    got = read_spec(RouterSpec, Path(router_child(SPEC, TenantRegistry.dev(), tmp_path).argv[-1]))
    assert got.no_auth and got.tenants_file is None
    assert tenants_of(got).auth == "none"
    assert not (tmp_path / "tenants.json").exists()


def _fields(spec: RouterSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in RouterSpec.__dataclass_fields__}


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("[1", "not a JSON router spec"),
        (encode_spec(SPEC).replace("RouterSpec", "WorkerSpec"), "expected kvfence.RouterSpec"),
        (_doc(timeouts={}), "unknown fields ['timeouts']"),
        (_doc(port="8080"), "RouterSpec.port must be int"),
        (_doc(port=70000), "RouterSpec.port must be in 0..65535"),
        (_doc(decode_addr=[]), "RouterSpec.decode_addr needs at least one decode worker"),
        (_doc(transport="inprocess"), "RouterSpec.transport is one of tcp, shm"),
        (_doc(log_level="loud"), "RouterSpec.log_level is one of critical"),
        (_doc(scrub="bleach"), "RouterSpec.scrub: unknown policy 'bleach'"),
        (_doc(faults=["no-such"]), "unknown fault switch 'no-such'"),
        (_doc(no_auth=True), "RouterSpec.no_auth excludes RouterSpec.tenants_file"),
        (
            _doc(no_auth=True, tenants_file=None, host="0.0.0.0"),
            "only allowed on a loopback host",
        ),
    ],
)
def test_a_bad_router_spec_is_refused_naming_the_field(raw: str, why: str) -> None:
    with pytest.raises(SpecError) as e:
        decode_spec(RouterSpec, raw)
    assert why in str(e.value)


def _router_entry(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfence.hub.router_entry", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_router_entry_exits_2_on_a_bad_spec_before_it_binds(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text(_doc(port=-1))
    out = _router_entry(path)
    assert out.returncode == 2
    assert "bad router spec: RouterSpec.port must be in 0..65535, got -1" in out.stderr


def test_the_router_entry_exits_2_on_an_unreadable_tenants_file(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text(_doc(tenants_file=str(tmp_path / "missing.json")))
    out = _router_entry(path)
    assert out.returncode == 2
    assert "RouterSpec.tenants_file: cannot read tenants file" in out.stderr


@pytest.mark.parametrize("mode", [["--role", "router"], ["--disaggregated", "--router", "kvfence"]])
def test_both_router_entries_check_the_options_by_the_same_spec(mode: list[str]) -> None:
    """The operator's `--role router` and the supervisor parse the same options and build the
    spec with one method: a bad option is the same usage error (exit 2) in both, before any
    process starts."""
    args = ["serve", *mode, "--model", "/nonexistent/m", "--log-level", "loud", "--no-auth"]
    if mode[0] == "--role":
        args += ["--inbox", "tcp://127.0.0.1:1", "--prefill-addr", "tcp://127.0.0.1:2"]
        args += ["--decode-addr", "tcp://127.0.0.1:3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--log-level': 'loud' is not one of 'critical'" in result.output
