"""Pure pieces of the server: tenant keys (I10), stop strings and UTF-8 on the output path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import TokenChunk
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.errors import ApiError
from kvfence.serve.output import OutputAssembler
from kvfence.serve.protocol import parse_completion
from kvfence.serve.tenants import Tenant, TenantFileError, TenantRegistry

KEY_A = "sk-aaaaaaaaaaaaaaaaaaaa"
KEY_A2 = "sk-a2a2a2a2a2a2a2a2a2a2"
KEY_B = "sk-bbbbbbbbbbbbbbbbbbbb"


def registry() -> TenantRegistry:
    return TenantRegistry((Tenant("a", (KEY_A, KEY_A2)), Tenant("b", (KEY_B,))))


def test_authenticate_maps_each_key_to_its_tenant_only() -> None:
    r = registry()
    assert r.authenticate(f"Bearer {KEY_A}") == "a"
    assert r.authenticate(f"bearer   {KEY_A2}  ") == "a"
    assert r.authenticate(f"Bearer {KEY_B}") == "b"
    for header in (None, "", "Bearer", f"Basic {KEY_A}", f"Bearer {KEY_A[:-1]}", f"Bearer {KEY_A}x",
                   f"Bearer {KEY_A.upper()}", "Bearer sk-\udcff" + "a" * 20, f"{KEY_A}"):  # fmt: skip
        assert r.authenticate(header) is None, header


def test_dev_mode_is_one_default_tenant() -> None:
    dev = TenantRegistry.dev()
    assert dev.auth == "none" and dev.authenticate(None) == "default"
    with pytest.raises(ValueError):
        TenantRegistry((Tenant("a", ()),), auth="none")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("not json", "cannot read"),
        (json.dumps({"tenants": [{"name": "a"}]}), "tenants[0]"),
        (json.dumps({"tenants": [], "extra": 1}), "expected"),
        (json.dumps({"tenants": []}), "at least one tenant"),
        (json.dumps({"tenants": [{"name": "a", "keys": ["short"]}]}), ">= 16"),
        (json.dumps({"tenants": [{"name": "a b", "keys": [KEY_A]}]}), "must match"),
        (json.dumps({"tenants": [{"name": "a", "keys": []}]}), "no keys"),
        (
            json.dumps(
                {"tenants": [{"name": "a", "keys": [KEY_A]}, {"name": "a", "keys": [KEY_B]}]}
            ),
            "listed twice",
        ),
        (
            json.dumps(
                {"tenants": [{"name": "a", "keys": [KEY_A]}, {"name": "b", "keys": [KEY_A]}]}
            ),
            "also used",
        ),
    ],
)
def test_bad_tenants_files_are_refused(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(content)
    with pytest.raises(TenantFileError) as e:
        TenantRegistry.from_file(path)
    assert fragment in str(e.value) and str(path) in str(e.value)


def test_generated_tenants_round_trip_through_a_file(tmp_path: Path) -> None:
    gen = TenantRegistry.generate(("x", "y"))
    path = tmp_path / "t.json"
    path.write_text(gen.to_json())
    assert TenantRegistry.from_file(path) == gen
    assert gen.tenants[0].keys != gen.tenants[1].keys


def test_neutral_values_of_unsupported_fields_are_accepted_others_refused() -> None:
    ok = parse_completion(
        {"prompt": "x", "n": 1, "echo": False, "presence_penalty": 0, "logit_bias": {}}
    )
    assert ok.prompt == "x"
    for field, value in (("n", True), ("echo", 0), ("best_of", 2), ("frequency_penalty", 0.1)):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": "x", field: value})
        assert e.value.param == field and e.value.status == 400


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from kvfence.model.tiny import make_tiny_checkpoint

    return Tokenizer.from_dir(make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "t"))


def feed(
    tok: Tokenizer, text: str, stops: tuple[str, ...], per_chunk: int = 1
) -> tuple[list[str], OutputAssembler]:
    ids = tok.encode(text)
    out = OutputAssembler(tok, stops, want_logprobs=False)
    pieces = []
    for i in range(0, len(ids), per_chunk):
        last = i + per_chunk >= len(ids)
        chunk = TokenChunk(
            "r", tuple(ids[i : i + per_chunk]), finish_reason="length" if last else None
        )
        pieces.append(out.push(chunk).text)
        if out.done:
            break
    return pieces, out


def test_stop_string_spanning_tokens_is_never_partly_emitted(tokenizer: Tokenizer) -> None:
    text = "one two ##END## three"
    pieces, out = feed(tokenizer, text, ("##END##",))
    assert "".join(pieces) == "one two " and out.finish_reason == "stop"
    for i in range(len(pieces)):  # no prefix of the stop string ever left early
        assert "#" not in "".join(pieces[: i + 1])


def test_earliest_of_several_stops_wins_and_no_stop_means_full_text(tokenizer: Tokenizer) -> None:
    pieces, out = feed(tokenizer, "abc XYZ def UVW", ("UVW", "XYZ"), per_chunk=3)
    assert "".join(pieces) == "abc " and out.finish_reason == "stop"
    pieces, out = feed(tokenizer, "nothing to stop here", ("zzz",))
    assert "".join(pieces) == "nothing to stop here" and out.finish_reason == "length"


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    text = "snow ☃ and 猫 and 🙂!"
    pieces, out = feed(tokenizer, text, ())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert out.completion_tokens == len(tokenizer.encode(text))


def test_room_ids_are_unique_and_a_collision_is_detected(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """I9: rooms come from `secrets`; a repeated draw is caught, counted and never reused."""
    from kvfence.model.tiny import make_tiny_checkpoint
    from kvfence.serve.app import create_app
    from kvfence.serve.build import LocalSpec, PoolSizes, build_local
    from kvfence.serve.router import ROOM_ATTEMPTS

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("rooms") / "t")
    parts = build_local(LocalSpec(ckpt, kind="mirror", pools=PoolSizes(512, 512)))
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, TenantRegistry.dev())
    router = app.state.router
    rooms = {router.new_room("default") for _ in range(1000)}
    assert len(rooms) == 1000 and all(len(r) == 32 for r in rooms)
    # Force the generator to repeat itself: the router must refuse, not share a room.
    monkeypatch.setattr("kvfence.serve.router.secrets.token_hex", lambda n: next(iter(rooms)))
    with pytest.raises(ApiError) as e:
        router.new_room("default")
    assert e.value.status == 500 and e.value.code == "room_collision"
    assert router.counters.room_collisions == ROOM_ATTEMPTS


def test_the_step_budget_reaches_every_engine_a_serve_command_builds(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`--max-batch-tokens`: the single-process engine, the hub's workers, SGLang's workers."""
    import click

    from kvfence.launch.cli import serve
    from kvfence.launch.options import Role, ServeOptions, stack_worker_argv
    from kvfence.model.tiny import make_tiny_checkpoint
    from kvfence.serve.build import LocalSpec, PoolSizes, build_local
    from kvfence.serve.specs import engine_config

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("budget") / "t")
    argv = ["--max-batch-tokens", "64", "--model", str(ckpt), "--kv-pages", "64"]
    params = serve.make_context("serve", argv).params
    assert params["max_batch_tokens"] == 64
    default = serve.make_context("serve", []).params["max_batch_tokens"]
    assert default == EngineConfig(prefill_pages=1, decode_pages=1).max_batch_tokens
    with pytest.raises(click.BadParameter, match="x>=1") as bad:
        serve.make_context("serve", ["--max-batch-tokens", "0"])
    assert bad.value.param is not None and bad.value.param.name == "max_batch_tokens"

    parts = build_local(
        LocalSpec(ckpt, kind="mirror", pools=PoolSizes(64, 64), max_batch_tokens=64)
    )
    assert parts.pipeline.config.max_batch_tokens == 64
    options = ServeOptions(**params)
    spec = options.worker_spec(Role.PREFILL, "-", "-")
    assert engine_config(spec, parts.loaded).max_batch_tokens == 64
    args = stack_worker_argv(options)
    assert args[args.index("--max-batch-tokens") + 1] == "64"


def test_the_prefill_order_reaches_every_engine_a_serve_command_builds(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`--prefill-order`: the single-process engine, the hub's workers, SGLang's workers."""
    import click

    from kvfence.engine.prefill_order import PrefillOrder
    from kvfence.launch.cli import serve
    from kvfence.launch.options import Role, ServeOptions, stack_worker_argv
    from kvfence.model.tiny import make_tiny_checkpoint
    from kvfence.serve.build import LocalSpec, PoolSizes, build_local
    from kvfence.serve.specs import engine_config

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("order") / "t")
    default = serve.make_context("serve", []).params["prefill_order"]
    assert default is EngineConfig(prefill_pages=1, decode_pages=1).prefill_order
    argv = ["--prefill-order", "arrival", "--model", str(ckpt), "--kv-pages", "64"]
    params = serve.make_context("serve", argv).params
    with pytest.raises(click.BadParameter, match="shortest") as bad:
        serve.make_context("serve", ["--prefill-order", "longest"])
    assert bad.value.param is not None and bad.value.param.name == "prefill_order"

    parts = build_local(
        LocalSpec(ckpt, kind="mirror", pools=PoolSizes(64, 64), prefill_order=PrefillOrder.ARRIVAL)
    )
    assert parts.pipeline.config.prefill_order is PrefillOrder.ARRIVAL
    options = ServeOptions(**params)
    spec = options.worker_spec(Role.PREFILL, "-", "-")
    assert engine_config(spec, parts.loaded).prefill_order is PrefillOrder.ARRIVAL
    args = stack_worker_argv(options)
    assert args[args.index("--prefill-order") + 1] == "arrival"
