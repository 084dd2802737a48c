"""Session fixtures for the real peer engines: each peer starts once per test session.

The peers come from the cache `make peers` fills (bench/peers/install.sh). Without it the
tests here skip and say so; with KVFENCE_REQUIRE_PEERS=1 (CI) a missing peer is an error,
so a broken install can never pass as a green run of skips.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerCache, PeerServer, start_llamacpp, start_vllm  # noqa: E402
from bench.peers.pd_fleet import VllmPdFleet, start_vllm_pd  # noqa: E402
from peer_helpers import (  # noqa: E402
    DEFAULT_PD,
    LEASE_PD,
    LLAMA_CTX,
    LLAMA_SLOTS,
    VLLM_BLOCKS,
    VLLM_MAX_MODEL_LEN,
    PdShape,
)


def _need(peer: str) -> PeerCache:
    cache = PeerCache.from_env()
    installed = cache.vllm_installed() if peer == "vllm" else cache.llamacpp_installed()
    if not installed:
        reason = (
            f"{peer} peer not installed in {cache.root} "
            f"(run `make peers`, or set KVFENCE_PEER_CACHE)"
        )
        if os.environ.get("KVFENCE_REQUIRE_PEERS") == "1":
            pytest.fail(reason + "; KVFENCE_REQUIRE_PEERS=1 forbids skipping")
        pytest.skip(reason)
    return cache


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's seeded tiny checkpoint (head dim 32, byte-level BPE), written once."""
    from kvfence.model.tiny import make_tiny_checkpoint  # torch: imported only when a peer runs

    return make_tiny_checkpoint(tmp_path_factory.mktemp("peer-ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def vllm_peer(
    request: pytest.FixtureRequest, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PeerServer]:
    """One vLLM for the whole session (~55 s to start): 64 blocks, max_model_len 2048."""
    cache = _need("vllm")
    with start_vllm(
        tiny_checkpoint,
        num_gpu_blocks_override=VLLM_BLOCKS,
        max_model_len=VLLM_MAX_MODEL_LEN,
        enable_prompt_tokens_details=True,
        enforce_eager=True,
        log_dir=tmp_path_factory.mktemp("vllm-log"),
        cache=cache,
    ) as server:
        _stop_after_last_use(request, {"vllm_peer"}, server.stop)
        yield server


@pytest.fixture(scope="session")
def llamacpp_cache() -> PeerCache:
    """The peer cache, with llama.cpp installed (else skip, or fail under KVFENCE_REQUIRE_PEERS)."""
    return _need("llamacpp")


@pytest.fixture(scope="session")
def llamacpp_peer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PeerServer]:
    """One llama-server for the session: -c 4096 -np 2 (2,048 tokens per slot), --metrics."""
    cache = request.getfixturevalue("llamacpp_cache")
    with start_llamacpp(
        request.getfixturevalue("tiny_checkpoint"),
        ctx_size=LLAMA_CTX,
        parallel=LLAMA_SLOTS,
        threads=2,
        log_dir=tmp_path_factory.mktemp("llamacpp-log"),
        cache=cache,
    ) as server:
        _stop_after_last_use(request, {"llamacpp_peer"}, server.stop)
        yield server


PD_FIXTURES = frozenset({"vllm_pd", "vllm_pd_lease"})


class PdFleets:
    """At most one live vLLM P/D fleet: its two servers spin on both cores while they live, so
    a second fleet beside it would starve the first (and everything else on a 2-core host).

    `get(shape)` returns the running fleet when it has that shape, else stops it and starts
    one that has; `stop()` ends it. The session stops the fleet as soon as no test left in the
    run asks for one (`pytest_runtest_teardown` below), so its start-up is paid once per run
    of same-shape modules and its spinning never slows the tests after them.
    """

    def __init__(self, checkpoint: Path, logs: pytest.TempPathFactory, cache: PeerCache) -> None:
        self.checkpoint, self.logs, self.cache = checkpoint, logs, cache
        self.shape: PdShape | None = None
        self.fleet: VllmPdFleet | None = None
        self.started = 0

    def get(self, shape: PdShape) -> VllmPdFleet:
        if self.fleet is not None and self.shape == shape:
            return self.fleet
        self.stop()
        log_dir = self.logs.mktemp(f"vllm-pd-{shape.blocks}b-log")
        self.fleet = start_vllm_pd(
            self.checkpoint,
            blocks=shape.blocks,
            kv_lease_s=shape.kv_lease_s,
            log_dir=log_dir,
            cache=self.cache,
        )
        self.shape, self.started = shape, self.started + 1
        return self.fleet

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        self.fleet, self.shape = None, None


@pytest.fixture(scope="session")
def pd_fleets(
    request: pytest.FixtureRequest,
    tiny_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PdFleets]:
    """The session's one-at-a-time vLLM P/D fleet (vLLM and NIXL from the peer cache)."""
    cache = PeerCache.from_env()
    if not (cache.vllm_installed() and cache.nixl_installed()):
        reason = f"vLLM or NIXL not installed in {cache.root} (run `make peers`)"
        if os.environ.get("KVFENCE_REQUIRE_PEERS") == "1":
            pytest.fail(reason + "; KVFENCE_REQUIRE_PEERS=1 forbids skipping")
        pytest.skip(reason)
    pool = PdFleets(tiny_checkpoint, tmp_path_factory, cache)
    _stop_after_last_use(request, PD_FIXTURES, pool.stop)
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def vllm_pd(pd_fleets: PdFleets) -> VllmPdFleet:
    """The default fleet (16 blocks of 128 tokens per server, vLLM's 30 s lease), shared by
    every module that asks for it in a row."""
    return pd_fleets.get(DEFAULT_PD)


@pytest.fixture(scope="module")
def vllm_pd_lease(pd_fleets: PdFleets) -> VllmPdFleet:
    """The lease fleet (9 blocks, a 1 s lease): where honest requests outlive their lease."""
    return pd_fleets.get(LEASE_PD)


# Every peer spins or holds memory while it lives, and the P/D fleets pin both cores: a peer
# left running beside them slows every request they time. So each peer stops right after
# the last test in the run that asks for it, and the P/D tests run after all the others.
SESSION_PEERS = frozenset({"vllm_peer", "llamacpp_peer", *PD_FIXTURES})
STOPPERS = pytest.StashKey[list[tuple[frozenset[str], Callable[[], object]]]]()
POSITION = pytest.StashKey[dict[str, int]]()  # test id -> its place in the run
LAST_USE = pytest.StashKey[dict[str, int]]()  # peer fixture -> place of the last test using it


def _stop_after_last_use(
    request: pytest.FixtureRequest, names: set[str] | frozenset[str], stop: Callable[[], object]
) -> None:
    """Register `stop` to run once no later test asks for any fixture in `names`."""
    request.config.stash.setdefault(STOPPERS, []).append((frozenset(names), stop))


def _uses(item: pytest.Item, names: frozenset[str]) -> bool:
    return bool(names & set(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Within the peer tests' own places in the run, the P/D fleet tests go last (stable)."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in Path(str(item.path)).parents]
    ours = [items[i] for i in slots]
    ordered = sorted(ours, key=lambda item: _uses(item, PD_FIXTURES))
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop each peer whose last test this was."""
    stoppers = item.config.stash.get(STOPPERS, [])
    if not stoppers:
        return
    stash = item.config.stash
    if POSITION not in stash:
        run = item.session.items
        stash[POSITION] = {it.nodeid: i for i, it in enumerate(run)}
        stash[LAST_USE] = {
            name: max((i for i, it in enumerate(run) if _uses(it, frozenset({name}))), default=-1)
            for name in SESSION_PEERS
        }
    here, last = stash[POSITION].get(item.nodeid, -1), stash[LAST_USE]
    for names, stop in list(stoppers):
        if nextitem is None or max(last.get(n, -1) for n in names) <= here:
            stop()
            stoppers.remove((names, stop))
