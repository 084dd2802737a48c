"""Greedy output through the real sglang-router with Mooncake and NIXL equals single-process mode.

Two checkpoints, one prefill and one decode worker on loopback:
- tiny llama (real attention, so any KV that lands in the wrong place or is short changes
  the text), with the same prompts and pools as tests/pd/test_pd_e2e.py;
- smollm (SmolLM2-135M's geometry: 30 layers, 3 KV heads of 64, GQA), so a page table or
  layout that only holds for the tiny shape shows up too. Its random tokenizer covers only
  part of the model's vocabulary and most sampled ids print as "", so it compares the greedy
  path's log-probabilities: a different token anywhere changes every value after it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "pd"))  # tests/pd: test_pd_e2e.py
from test_pd_e2e import PROMPTS, _complete, _single_process_texts

from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.stack import Stack, StackSpec

pytestmark = pytest.mark.slow

TRANSPORTS = ["mooncake", "nixl"]
SMOLLM_CONTEXT = 256
SMOLLM_PAGES = 64  # 1,024 tokens per role: 4 contexts, above the gate's 1.25 headroom
SMOLLM_PROMPTS = ["The quick brown fox", "Tenant isolation holds by construction. " * 6, "a"]
SMOLLM_TOKENS = 12


def _through_router(
    checkpoint: Path,
    transport: str,
    workdir: Path,
    worker_args: Sequence[str],
    prompts: Sequence[str],
    complete: Callable[[openai.OpenAI, str, str], Any],
) -> list[Any]:
    """Each prompt's answer through router + workers, after checking decode's transport."""
    pytest.importorskip("mooncake.engine" if transport == "mooncake" else "nixl_cu12")
    tenants = TenantRegistry.generate(("a",))
    tenants_file = workdir / "tenants.json"
    tenants_file.touch(mode=0o600)
    tenants_file.write_text(tenants.to_json())
    args = (
        "--model", str(checkpoint), "--model-kind", "llama", "--transport", transport,
        "--torch-threads", "1", *worker_args,
    )  # fmt: skip
    with (
        Stack(StackSpec(args, tenants_file), workdir=workdir) as stack,
        httpx.Client(trust_env=False, timeout=180) as http,
    ):
        client = openai.OpenAI(
            base_url=f"{stack.url}/v1",
            api_key=tenants.tenants[0].keys[0],
            max_retries=0,
            http_client=http,
        )
        got = [complete(client, checkpoint.name, p) for p in prompts]
        decode = next(w for w in stack.workers if w.role == "decode")
        facts = http.get(f"{stack.router_url_of(decode)}/server_info").json()
    assert facts["disaggregation_transfer_backend"] == transport, facts
    return got


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_greedy_through_the_router_equals_single_process(
    sgl_checkpoint: Path, tmp_path: Path, transport: str
) -> None:
    pools = ("--kv-pages", "prefill=512,decode=512")
    got = _through_router(sgl_checkpoint, transport, tmp_path, pools, PROMPTS, _complete)
    assert got == _single_process_texts(sgl_checkpoint)


# ---- smollm: the greedy path's log-probabilities ------------------------------------------


def _logprobs(client: openai.OpenAI, model: str, prompt: str) -> list[float]:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=SMOLLM_TOKENS, temperature=0, logprobs=1
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs, out
    values = [float(v) for v in choice.logprobs.token_logprobs if v is not None]
    assert len(values) == SMOLLM_TOKENS, out
    return values


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm") / "smollm"
    argv = [sys.executable, "-m", "kvfence", "make-model", str(out), "--preset", "smollm"]
    subprocess.run(argv, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def smollm_single_process(smollm: Path) -> list[list[float]]:
    return _single_process_texts(
        smollm,
        prompts=SMOLLM_PROMPTS,
        complete=_logprobs,
        context_length=SMOLLM_CONTEXT,
        pages=SMOLLM_PAGES,
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_smollm_greedy_through_the_router_equals_single_process(
    smollm: Path, smollm_single_process: list[list[float]], tmp_path: Path, transport: str
) -> None:
    args = (
        "--context-length", str(SMOLLM_CONTEXT),
        "--kv-pages", f"prefill={SMOLLM_PAGES},decode={SMOLLM_PAGES}",
    )  # fmt: skip
    got = _through_router(smollm, transport, tmp_path, args, SMOLLM_PROMPTS, _logprobs)
    assert len(got) == len(smollm_single_process)
    for routed, local in zip(got, smollm_single_process, strict=True):
        assert routed == pytest.approx(local, abs=1e-4)  # the parity tests' tolerance
