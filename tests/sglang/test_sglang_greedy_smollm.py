"""Greedy text through the real sglang-router equals single-process mode on smollm.

The tiny checkpoint (test_sglang_greedy.py) has 2 layers; smollm has SmolLM2-135M's
geometry (30 layers, 3 KV heads of 64, GQA), so a page table or layout that only holds
for the tiny shape shows up here as different text. One stack per transport, a short
context so the pools stay small, and few output tokens: it checks where the KV lands,
not how fast it decodes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from kvfence.serve.app import create_app
from kvfence.serve.build import build_local
from kvfence.serve.pool_sizing import PoolSizes
from kvfence.serve.sglang.stack import Stack, StackSpec
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

pytestmark = pytest.mark.slow

CONTEXT = 256
PAGES = 64  # 1,024 tokens per role: 4 contexts, above the gate's 1.25 headroom
PROMPTS = ["The quick brown fox", "Tenant isolation holds by construction. " * 6, "a"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm") / "smollm"
    argv = [sys.executable, "-m", "kvfence", "make-model", str(out), "--preset", "smollm"]
    subprocess.run(argv, check=True, capture_output=True)
    return out


def _complete(client: openai.OpenAI, model: str, prompt: str) -> list[float]:
    """The greedy path's log-probabilities: the random checkpoint's tokenizer covers only
    part of the model's vocabulary, so most sampled ids print as "" and the text alone
    would compare nothing; a different token anywhere changes every value after it."""
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs, out
    values = [float(v) for v in choice.logprobs.token_logprobs if v is not None]
    assert len(values) == MAX_TOKENS, out
    return values


@pytest.fixture(scope="module")
def single_process(smollm: Path) -> list[list[float]]:
    parts = build_local(
        smollm,
        kind="llama",
        context_length=CONTEXT,
        pools=PoolSizes(prefill_pages=PAGES, decode_pages=PAGES),
    )
    tenants = TenantRegistry.generate(("a",))
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv:
            client = openai.OpenAI(
                base_url=f"{srv.url}/v1", api_key=tenants.tenants[0].keys[0], max_retries=0
            )
            return [_complete(client, smollm.name, p) for p in PROMPTS]
    finally:
        parts.pipeline.stop()


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_smollm_greedy_through_the_router_equals_single_process(
    smollm: Path, single_process: list[list[float]], tmp_path: Path, transport: str
) -> None:
    pytest.importorskip("mooncake.engine" if transport == "mooncake" else "nixl_cu12")
    tenants = TenantRegistry.generate(("a",))
    tenants_file = tmp_path / "tenants.json"
    tenants_file.touch(mode=0o600)
    tenants_file.write_text(tenants.to_json())
    args = (
        "--model", str(smollm), "--model-kind", "llama", "--transport", transport,
        "--context-length", str(CONTEXT), "--kv-pages", f"prefill={PAGES},decode={PAGES}",
        "--torch-threads", "1",
    )  # fmt: skip
    with (
        Stack(StackSpec(args, tenants_file), workdir=tmp_path) as stack,
        httpx.Client(trust_env=False, timeout=180) as http,
    ):
        client = openai.OpenAI(
            base_url=f"{stack.url}/v1",
            api_key=tenants.tenants[0].keys[0],
            max_retries=0,
            http_client=http,
        )
        got = [_complete(client, smollm.name, p) for p in PROMPTS]
        decode = next(w for w in stack.workers if w.role == "decode")
        facts = http.get(f"{stack.router_url_of(decode)}/server_info").json()
    assert facts["disaggregation_transfer_backend"] == transport, facts
    assert len(got) == len(single_process)
    for routed, local in zip(got, single_process, strict=True):
        assert routed == pytest.approx(local, abs=1e-4)  # the parity tests' tolerance
