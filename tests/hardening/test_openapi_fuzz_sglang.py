"""The generated API attacks of test_openapi_fuzz.py through `kvfence serve --disaggregated`.

The same operations, credentials and checks, sent to the stack's public address: kvfence's
edge in front of the real sglang-router and a prefill and a decode worker on loopback. The
schema is the one that address serves. Every answer is a 2xx that matches the schema or a
4xx that names its field, never a 5xx; afterwards neither worker holds a page.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from schemathesis_cli import checks_all
from test_openapi_fuzz import CLI_EXAMPLES, PER_CASE, attack_all

from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.stack import Stack, StackSpec

pytestmark = pytest.mark.slow


@dataclass
class Routed:
    """What `_attack` reads of a server (its URL), plus the stack's own quiet check."""

    url: str
    stack: Stack
    tenants: TenantRegistry

    def auth(self, tenant: str | None = None) -> dict[str, str]:
        name = tenant or self.tenants.tenants[0].name
        key = next(t.keys[0] for t in self.tenants.tenants if t.name == name)
        return {"Authorization": f"Bearer {key}"}

    def operator_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tenants.operator_keys[0]}"}

    def pages_in_use(self) -> dict[str, int]:
        """Each worker's held pages, from what it tells its router (on the router's path)."""
        held = {}
        for w in self.stack.workers:
            r = httpx.get(f"{self.stack.router_url_of(w)}/server_info", timeout=30)
            facts = r.json()
            held[w.role] = int(facts["pages_used"]) + int(facts["pages_pending"])
        return held

    def settle(self, deadline_s: float = 60.0) -> dict[str, int]:
        end = time.monotonic() + deadline_s
        held = self.pages_in_use()
        while any(held.values()) and time.monotonic() < end:
            time.sleep(0.2)
            held = self.pages_in_use()
        return held


@pytest.fixture(scope="module")
def routed(
    hardening_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Routed]:
    tmp = tmp_path_factory.mktemp("fuzz-sglang")
    tenants = TenantRegistry.generate(("a", "b")).with_operator_keys(
        ("hardening-operator-key-0001",)
    )
    tenants_file = tmp / "tenants.json"
    tenants_file.touch(mode=0o600)
    tenants_file.write_text(tenants.to_json())
    args = (
        "--model", str(hardening_checkpoint), "--model-kind", "mirror", "--context-length", "256",
        "--kv-pages", "prefill=256,decode=256", "--torch-threads", "1", "--no-prefix-cache",
    )  # fmt: skip
    with Stack(StackSpec(args, tenants_file), workdir=tmp) as stack:
        yield Routed(stack.url, stack, tenants)


def test_generated_requests_through_sglang_router_get_2xx_or_a_4xx_naming_the_field(
    routed: Routed,
) -> None:
    tally = attack_all(routed)
    assert tally.requests >= 1000 or PER_CASE < 120, f"only {tally.requests} requests were sent"
    assert not [s for s in tally.statuses if s.startswith("5")], tally.statuses
    assert not tally.problems, "\n".join(tally.problems[:30])
    assert routed.settle() == {"prefill": 0, "decode": 0}


def test_schemathesis_checks_all_through_sglang_router(routed: Routed, tmp_path: Path) -> None:
    """schemathesis' own command line, every check it has, against the stack's public address."""
    run = checks_all(routed.url, routed.auth()["Authorization"].split()[1], CLI_EXAMPLES, tmp_path)
    print(run.summary)
    assert run.returncode == 0, run.summary
    assert routed.settle() == {"prefill": 0, "decode": 0}
