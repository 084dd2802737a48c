"""`kvfence serve` parses its options once into a typed `ServeOptions`, and every role's spec
is derived from it: each click option is a field, each flag arrives as its type, what no
single flag can check is a usage error naming the flags, and the sglang-router stack's
workers, parsing the arguments they are given, hold the same options as their supervisor."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.engine.prefill_order import PrefillOrder
from kvfence.faults import Fault, FaultSet
from kvfence.kv.scrub import ScrubPolicy
from kvfence.launch.cli import serve
from kvfence.launch.option_types import PerRole
from kvfence.launch.options import (
    PDRouter,
    Role,
    ServeOptions,
    sglang_worker_spec,
    stack_spec,
    stack_worker_argv,
)
from kvfence.serve.config import ServeConfig
from kvfence.serve.specs import RouterSpec, SglangWorkerSpec, WorkerSpec, decode_spec, encode_spec

MODEL = ["--model", "/models/m"]  # never read: nothing here loads a model


def parse(*argv: str) -> ServeOptions:
    return ServeOptions(**serve.make_context("serve", [*MODEL, *argv]).params)


def test_every_click_option_is_a_field_of_the_options() -> None:
    options = {p.name for p in serve.params if isinstance(p, click.Option)}
    fields = {f.name for f in dataclasses.fields(ServeOptions)}
    assert options == fields


def test_each_flag_arrives_as_its_type() -> None:
    o = parse(
        "--scrub", "on_release", "--prefill-order", "arrival", "--kv-pages", "prefill=8",
        "--kv-bytes", "4096", "--lab-fault", "early-free", "--no-prefix-cache",
        "--role", "decode", "--inbox", "tcp://10.0.0.2:7001", "--router-addr", "tcp://r:7000",
        "--request-log", "/tmp/r.jsonl", "--log-level", "INFO",
    )  # fmt: skip
    assert o.scrub is ScrubPolicy.ON_RELEASE and o.prefill_order is PrefillOrder.ARRIVAL
    assert o.kv_pages == PerRole(prefill=8) and o.kv_bytes == PerRole(4096, 4096)
    assert o.faults == FaultSet.of(Fault.EARLY_FREE) and o.prefix_cache is False
    assert o.role is Role.DECODE and o.pd_router is PDRouter.KVFENCE
    assert o.model_dir == Path("/models/m") and o.request_log == Path("/tmp/r.jsonl")
    assert o.log_level == "info"  # uvicorn's name for it
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-pages", "0"], "Invalid value for '--kv-pages': '0': give N (both roles) or "
         "prefill=N,decode=M, each >= 1"),
        (["--kv-bytes", "prefill=1,cache=2"], "Invalid value for '--kv-bytes'"),
        (["--headroom", "0.5"], "Invalid value for '--headroom': 0.5 is not in the range x>=1.0"),
        (["--lab-fault", "no-such"], "Invalid value for --lab-fault: unknown fault switch "
         "'no-such'; known switches: "),
        (["--scrub", "bleach"], "'bleach' is not one of 'none', 'on_release', 'on_allocate'"),
        (["--log-level", "loud"], "Invalid value for '--log-level'"),
        (["--router", "kvfence"], "--router chooses the router in front of the workers: give "
         "--disaggregated or --role with it"),
        (["--disaggregated", "--role", "prefill"], "--disaggregated starts every role; --role "
         "runs one of them"),
        (["--role", "decode", "--inbox", "tcp://a:1"], "--role decode needs --router-addr"),
        (["--role", "router", "--inbox", "tcp://a:1", "--prefill-addr", "tcp://p:1"],
         "--role router needs --prefill-addr and --decode-addr (at least one each)"),
        (["--router", "sglang", "--role", "router"], "with --router sglang, --role is prefill "
         "or decode"),
        (["--router", "sglang", "--role", "prefill"], "needs --router-secret-file"),
        (["--no-auth", "--host", "10.0.0.1"], "--no-auth is only allowed on a loopback host"),
        (["--pair-timeout", "0"], "Invalid value for '--pair-timeout': 0.0 is not in the range"),
    ],
)  # fmt: skip
def test_a_bad_option_is_a_usage_error_naming_the_flag(argv: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["serve", *MODEL, *argv])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


# What a spec or the server's config carries that no option of `kvfence serve` names: each
# is a concept of its own, never another spelling of an option.
NOT_OPTIONS: dict[type, set[str]] = {
    WorkerSpec: set(),
    RouterSpec: set(),
    SglangWorkerSpec: {"worker", "secret"},  # the engine's spec; the secret file's content
    ServeConfig: {"model_name", "vocab_size", "lab_profile", "body_timeout_s"},  # not flags
}


def misnamed(cls: type, options: set[str]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - options - NOT_OPTIONS[cls]


def test_a_concept_has_one_name_from_the_flag_to_the_config() -> None:
    # `--scrub` is `scrub` in the options, every spec and the server's config; a field that
    # says the same thing in other words (scrub_policy, prefill for prefill_addr) is drift,
    # and so is an option's name on another concept (`router`, the choice of router, on the
    # router's control address).
    options = {f.name for f in dataclasses.fields(ServeOptions)}
    assert {cls.__name__: misnamed(cls, options) for cls in NOT_OPTIONS} == {
        cls.__name__: set() for cls in NOT_OPTIONS
    }


def _as_carried(value: object, role: str) -> object:
    """An option's value as a spec carries it across a process: enums by value, paths as
    strings, the lab's switches by name, a per-role size as this role's."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, FaultSet):
        return tuple(value.names())
    return value.of(role) if isinstance(value, PerRole) else value


def test_a_field_named_as_an_option_carries_that_options_value(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    o = parse(
        "--role", "prefill", "--inbox", "tcp://w:1", "--router-addr", "tcp://r:1",
        "--prefill-addr", "tcp://w:1", "--decode-addr", "tcp://w:2", "--scrub", "on_release",
        "--kv-pages", "prefill=8", "--lab-fault", "no-invalidate", "--host", "127.0.0.2",
        "--port", "8123", "--bootstrap-port", "9123", "--torch-threads", "2",
        "--router-secret-file", str(secret), "--tenants", str(tmp_path / "t.json"),
    )  # fmt: skip
    assert o.router_addr is not None and o.inbox is not None
    worker = o.worker_spec(Role.PREFILL, o.inbox, o.router_addr)
    specs = (
        worker,
        o.router_spec(o.inbox, o.prefill_addr, o.decode_addr),
        sglang_worker_spec(o, worker),
    )
    given = {f.name: getattr(o, f.name) for f in dataclasses.fields(ServeOptions)}
    differ = [
        f"{type(spec).__name__}.{name}: {getattr(spec, name)!r} is not {value!r}"
        for spec in specs
        for name, value in given.items()
        if name in {f.name for f in dataclasses.fields(spec)}
        and getattr(spec, name) != _as_carried(value, "prefill")
    ]
    assert differ == []


def test_the_worker_and_router_specs_are_the_options_own() -> None:
    o = parse(
        "--scrub", "on_allocate", "--shared-prefix-cache", "--kv-pages", "prefill=8,decode=16",
        "--lab-fault", "no-invalidate", "--transport", "shm", "--context-length", "512",
        "--prefill-order", "arrival", "--torch-threads", "3",
    )  # fmt: skip
    prefill = o.worker_spec(Role.PREFILL, "tcp://w:1", "tcp://r:1")
    decode = o.worker_spec(Role.DECODE, "tcp://w:2", "tcp://r:1", torch_threads=1)
    assert (prefill.kv_pages, decode.kv_pages) == (8, 16)
    assert (prefill.torch_threads, decode.torch_threads) == (3, 1)
    assert prefill.scrub == "on_allocate" and prefill.prefill_order == "arrival"
    assert prefill.shared_prefix_cache and prefill.faults == ("no-invalidate",)
    router = o.router_spec("tcp://r:1", ("tcp://w:1",), ("tcp://w:2",))
    config_fields = (router.scrub, router.shared_prefix_cache, router.context_length)
    assert config_fields == ("on_allocate", True, 512)
    # Each crosses to its process whole and arrives equal.
    assert decode_spec(WorkerSpec, encode_spec(prefill)) == prefill
    assert decode_spec(RouterSpec, encode_spec(router)) == router


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--scrub", "on_release", "--kv-pages", "prefill=8", "--kv-bytes", "65536",
         "--no-prefix-cache", "--shared-prefix-cache", "--allow-undersized-pool",
         "--lab-fault", "early-free", "--lab-fault", "no-invalidate", "--headroom", "1.5",
         "--context-length", "256", "--prefill-order", "arrival", "--log-level", "debug",
         "--transport", "shm", "--kv-host", "10.0.0.3", "--torch-threads", "2"],
    ],
)  # fmt: skip
def test_the_stacks_workers_parse_the_options_they_were_given(argv: list[str]) -> None:
    o = parse("--disaggregated", *argv)
    worker = parse(*stack_worker_argv(o))
    shared = set(ServeOptions.__dataclass_fields__) - {
        # The worker's own: its role's addresses, the stack's shape, the public listener.
        "model_dir", "preset", "host", "port", "tenants_file", "unlimited_tenants", "no_auth",
        "operator_keys", "request_log", "disaggregated", "n_prefill", "n_decode", "role",
        "inbox", "router_addr", "prefill_addr", "decode_addr", "router", "bootstrap_port",
        "router_secret_file", "torch_threads",
    }  # fmt: skip
    assert {f: getattr(worker, f) for f in shared} == {f: getattr(o, f) for f in shared}
    assert worker.torch_threads == o.worker_threads


def test_the_stacks_workers_take_turns_on_the_cores_unless_a_thread_count_is_given(
    tmp_path: Path,
) -> None:
    tenants = tmp_path / "tenants.json"
    assert stack_spec(parse("--disaggregated"), tenants).share_cores is True
    assert (
        stack_spec(parse("--disaggregated", "--torch-threads", "1"), tenants).share_cores is False
    )
