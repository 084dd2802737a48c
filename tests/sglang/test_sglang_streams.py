"""16 concurrent streams from 4 tenants through the real sglang-router (issue 10, "How it is checked").

The mirror model replays the KV it attends, so each stream's text is exactly
its own prompt when, and only when, decode attended that request's own pages,
which arrived over the transfer from the prefill worker that the router paired
it with. One prefill and two decode workers, TCP transport, on loopback.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.stack import Stack, StackSpec, Worker

pytestmark = pytest.mark.slow

TENANTS = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def routed(
    sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("sgl-streams")
    tenants = TenantRegistry.generate(TENANTS)
    tenants_file = tmp / "tenants.json"
    tenants_file.touch(mode=0o600)
    tenants_file.write_text(tenants.to_json())
    args = (
        "--model", str(sgl_checkpoint), "--model-kind", "mirror", "--transport", "tcp",
        "--kv-pages", "prefill=512,decode=512", "--torch-threads", "1", "--no-prefix-cache",  # cached pages would stay held
    )  # fmt: skip
    with Stack(StackSpec(args, tenants_file, n_prefill=1, n_decode=2), workdir=tmp) as s:
        yield s, {t.name: t.keys[0] for t in tenants.tenants}


def _quiet(stack: Stack, worker: Worker, timeout: float = 30) -> dict[str, Any]:
    """A worker's facts (on the router's path) once its pool is empty, or the last seen."""
    end = time.monotonic() + timeout
    while True:
        facts = dict(httpx.get(f"{stack.router_url_of(worker)}/server_info", timeout=10).json())
        done = facts["pages_used"] == 0 and facts["pages_pending"] == 0 and facts["integrity"]
        if done or time.monotonic() > end:
            return facts
        time.sleep(0.2)


def test_16_streams_from_4_tenants_each_get_their_own_echo(
    routed: tuple[Stack, dict[str, str]], sgl_checkpoint: Path
) -> None:
    stack, keys = routed
    tokenizer = Tokenizer.from_dir(sgl_checkpoint)
    http = httpx.Client(trust_env=False, timeout=180)
    clients = {
        t: openai.OpenAI(
            base_url=f"{stack.url}/v1", api_key=keys[t], max_retries=0, http_client=http
        )
        for t in TENANTS
    }

    def run(i: int) -> tuple[str, str]:
        tenant = TENANTS[i % 4]
        prompt = f"tenant {tenant} request {i:02d} secret-{i * 7919:05d} "
        out = clients[tenant].completions.create(
            model=sgl_checkpoint.name,
            prompt=prompt,
            max_tokens=len(tokenizer.encode(prompt)),
            temperature=0,
            stream=True,
        )
        return prompt, "".join(chunk.choices[0].text for chunk in out if chunk.choices)

    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(run, range(16), timeout=300))
    finally:
        http.close()
    assert [text for _, text in results] == [prompt for prompt, _ in results]
    for w in stack.workers:
        facts = _quiet(stack, w)
        assert (facts["pages_used"], facts["pages_pending"], facts["integrity"]) == (0, 0, "ok"), (
            w,
            facts,
        )
