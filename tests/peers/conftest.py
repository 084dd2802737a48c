"""Session fixtures for the real peer engines: each peer starts once per test session.

The peers come from the cache `make peers` fills (bench/peers/install.sh). Without it the
tests here skip and say so; with KVFENCE_REQUIRE_PEERS=1 (CI) a missing peer is an error,
so a broken install can never pass as a green run of skips.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerCache, PeerServer, start_llamacpp, start_vllm  # noqa: E402
from peer_helpers import LLAMA_CTX, LLAMA_SLOTS, VLLM_BLOCKS, VLLM_MAX_MODEL_LEN  # noqa: E402


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
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
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
        yield server
