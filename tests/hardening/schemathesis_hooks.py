"""A check schemathesis loads (SCHEMATHESIS_HOOKS) for runs against a kvfence server.

`--checks all` runs every built-in check. One of them, positive_data_acceptance,
is run with 400 among its expected statuses, because some limits cannot be
written in JSON Schema (a prompt's tokens against the context window, prompt +
max_tokens against the edge limit). This check takes its place for 400s, and
is stricter: a schema-valid request may be refused with a 400 only under a
`param:code` that the operation lists in `x-kvfence-beyond-schema`; any other
400 to schema-valid data fails the run.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis import GenerationMode


@schemathesis.check
def kvfence_positive_400_is_beyond_schema(ctx: Any, response: Any, case: Any) -> bool | None:
    meta = case.meta
    if meta is None or meta.generation.mode != GenerationMode.POSITIVE:
        return None
    if response.status_code != 400:
        return None
    allowed = case.operation.definition.raw.get("x-kvfence-beyond-schema", [])
    try:
        error = response.json()["error"]
        where = f"{error.get('param')}:{error.get('code')}"
    except (ValueError, KeyError, TypeError):
        where = "no error envelope"
    if where not in allowed:
        raise AssertionError(
            f"schema-valid request refused with 400 {where}, which the operation does not list "
            f"as beyond the schema ({allowed}): {response.text[:300]}"
        )
    return None
