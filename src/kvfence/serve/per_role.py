"""Per-role CLI values: `N` for both roles, or `prefill=N,decode=M` (`--kv-pages`, `--kv-bytes`)."""

from __future__ import annotations

import click


def parse_per_role(value: str | None, option: str) -> tuple[int | None, int | None]:
    """`N` (both roles) or `prefill=N,decode=M` -> (prefill, decode)."""
    if value is None:
        return None, None
    try:
        if "=" not in value:
            n = int(value)
            return n, n
        parts = dict(p.split("=", 1) for p in value.split(","))
        if not set(parts) <= {"prefill", "decode"}:
            raise ValueError
        return (
            int(parts["prefill"]) if "prefill" in parts else None,
            int(parts["decode"]) if "decode" in parts else None,
        )
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: give N (both roles) or prefill=N,decode=M", param_hint=option
        ) from None
