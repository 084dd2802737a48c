"""Greedy text through the real sglang-router with Mooncake and NIXL equals single-process mode.

The tiny llama checkpoint (real attention, so any KV that lands in the wrong
place or is short changes the text), one prefill and one decode worker on
loopback, the same prompts and pools as tests/pd/test_pd_e2e.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "pd"))  # tests/pd: test_pd_e2e.py
from test_pd_e2e import PROMPTS, _complete, _single_process_texts

from kvfence.serve.sglang.stack import Stack, StackSpec
from kvfence.serve.tenants import TenantRegistry

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_greedy_through_the_router_equals_single_process(
    sgl_checkpoint: Path, tmp_path: Path, transport: str
) -> None:
    pytest.importorskip("mooncake.engine" if transport == "mooncake" else "nixl_cu12")
    tenants = TenantRegistry.generate(("a",))
    tenants_file = tmp_path / "tenants.json"
    tenants_file.touch(mode=0o600)
    tenants_file.write_text(tenants.to_json())
    args = (
        "--model", str(sgl_checkpoint), "--model-kind", "llama", "--transport", transport,
        "--kv-pages", "prefill=512,decode=512", "--torch-threads", "1",
    )  # fmt: skip
    with (
        Stack(StackSpec(args, tenants_file), workdir=tmp_path) as stack,
        httpx.Client(trust_env=False, timeout=120) as http,
    ):
        client = openai.OpenAI(
            base_url=f"{stack.url}/v1",
            api_key=tenants.tenants[0].keys[0],
            max_retries=0,
            http_client=http,
        )
        got = [_complete(client, sgl_checkpoint.name, p) for p in PROMPTS]
        decode = next(w for w in stack.workers if w.role == "decode")
        facts = http.get(f"{stack.router_url_of(decode)}/server_info").json()
    assert facts["disaggregation_transfer_backend"] == transport, facts
    assert got == _single_process_texts(sgl_checkpoint)
