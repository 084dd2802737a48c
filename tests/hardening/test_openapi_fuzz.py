"""Generated API attacks: schemathesis against /openapi.json on a live loopback server.

Every operation is attacked with schema-valid (positive) and schema-violating
(negative) requests, with a valid key, with a wrong key and with none. Each
answer must be a 2xx that matches the schema, or a 4xx whose error body
names the field (`error.param`); never a 5xx. Negative data must be refused
(schemathesis' `negative_data_rejection`): a schema that documented a field
the server ignores, or accepted what it refuses, fails here. Afterwards no
page is held and the ledger is consistent.

Then schemathesis' own command line with `--checks all` (every check it has:
undeclared methods answered 405 with `Allow`, a missing key a 401, ignored
auth, schema-valid data accepted, ...) against the single-process server and
against the hub (`kvfence serve --disaggregated --router kvfence`): 0 failures.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hardening_helpers import Live, error_problem, hub_cli, live_server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis_cli import checks_all

# Generated requests per POST operation and generation mode with a valid key (a quarter of it
# for each other credential); the CI default gives > 1,000 requests in all. GET operations
# take no input, so hypothesis stops them as soon as their few distinct requests are sent.
PER_CASE = int(os.environ.get("KVFENCE_FUZZ_EXAMPLES", "120"))
OPERATIONS = (
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/server_info"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
)
# Examples per operation and phase for the `--checks all` command-line runs (bounded for CI).
CLI_EXAMPLES = max(10, PER_CASE // 2)
HUB_START_S = 300.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def server(hardening_checkpoint: Path) -> Iterator[Live]:
    with live_server(hardening_checkpoint) as live:
        yield live


def test_openapi_is_served_and_matches_the_parsers(server: Live) -> None:
    r = httpx.get(server.url + "/openapi.json", headers=server.auth(), timeout=30)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    assert httpx.get(server.url + "/openapi.json", timeout=30).status_code == 401
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = body["schema"]
    assert schema["additionalProperties"] is False
    assert "n" in schema["x-kvfence-rejected-fields"]
    assert schema["properties"]["n"]["enum"] == [1, None]


class Tally:
    def __init__(self) -> None:
        self.statuses: Counter[str] = Counter()
        self.problems: list[str] = []
        self.requests = 0


def _attack(
    server: Live,
    schema: Any,
    tally: Tally,
    method: str,
    path: str,
    mode: GenerationMode,
    headers: dict[str, str],
    label: str,
    authed: bool,
) -> None:
    operation = schema[path][method]
    examples = PER_CASE if label.startswith("key/") else max(1, PER_CASE // 6)
    strategy = operation.as_strategy(generation_mode=mode, headers=headers)
    session = requests.Session()
    checks = [*CHECKS, negative_data_rejection] if mode.is_negative and authed else CHECKS

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(strategy)
        response = case.call(base_url=server.url, session=session, timeout=60)
        tally.requests += 1
        status = response.status_code
        tally.statuses[str(status)] += 1
        where = f"{label} {method} {path} -> {status}"
        try:
            case.validate_response(response, checks=checks)
        except Exception as e:  # a failed check: record it, keep attacking
            tally.problems.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")
        if not authed and path != "/health" and status != 401:
            tally.problems.append(f"{where}: answered without a valid key")
        if 400 <= status < 500:
            problem = error_problem(status, response.json())
            if problem:
                tally.problems.append(f"{where}: {problem} (sent {case.body!r:.200})")

    try:
        run()
    except Exception as e:
        tally.problems.append(f"{label} {method} {path}: {type(e).__name__}: {str(e)[:300]}")
    finally:
        session.close()


def attack_all(server: Any) -> Tally:
    """Every operation, with every credential (both tenants', the operator's, a wrong key and
    none), schema-valid; with the first tenant's key also schema-violating. `server` has
    `url`, `auth(tenant)` and `operator_auth()`."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=server.auth())
    tally = Tally()
    credentials = {
        "key": server.auth(),
        "other-tenant": server.auth("b"),
        "operator": server.operator_auth(),
        "wrong-key": {"Authorization": "Bearer sk-not-a-key-of-anyone-here"},
        "no-key": {},
    }
    for method, path in OPERATIONS:
        for label, headers in credentials.items():
            modes = [GenerationMode.POSITIVE]
            if label == "key" and method == "POST":
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                authed = label in ("key", "other-tenant", "operator")
                where = f"{label}/{mode.value}"
                _attack(server, schema, tally, method, path, mode, headers, where, authed)
    print(f"generated requests: {tally.requests}; statuses: {dict(sorted(tally.statuses.items()))}")
    return tally


def test_generated_requests_get_2xx_or_a_4xx_naming_the_field(server: Live) -> None:
    baseline = server.settle()
    tally = attack_all(server)
    assert tally.requests >= 1000 or PER_CASE < 120, f"only {tally.requests} requests were sent"
    assert not [s for s in tally.statuses if s.startswith("5")], tally.statuses
    assert not tally.problems, "\n".join(tally.problems[:30])
    assert server.settle() == baseline == {"prefill": 0, "decode": 0}


def test_schemathesis_checks_all_single_process(server: Live, tmp_path: Path) -> None:
    run = checks_all(server.url, server.key(), CLI_EXAMPLES, tmp_path)
    print(run.summary)
    assert run.returncode == 0, run.summary
    assert server.settle() == {"prefill": 0, "decode": 0}


@pytest.fixture(scope="module")
def hub(hardening_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`kvfence serve --disaggregated --router kvfence` started; yields 'URL KEY'."""
    args = ("--model", str(hardening_checkpoint), "--model-kind", "mirror", "--kv-pages", "512",
            "--port", "0")  # fmt: skip
    with hub_cli(args, tmp_path_factory.mktemp("hub"), HUB_START_S) as (text, _):
        url = m.group(1) if (m := re.search(r"at (http://\S+)", text)) else None
        key = m.group(1) if (m := re.search(r"key (sk-kvf-\w+)", text)) else None
        assert url and key, f"the hub did not announce itself in {HUB_START_S:g} s:\n{text}"
        yield f"{url} {key}"


def test_schemathesis_checks_all_hub(hub: str, tmp_path: Path) -> None:
    url, key = hub.split()
    run = checks_all(url, key, CLI_EXAMPLES, tmp_path)
    print(run.summary)
    assert run.returncode == 0, run.summary
