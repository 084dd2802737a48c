"""The lines a server prints once it listens: gate verdict, URL, keys, a curl to try.

Every entry point that serves prints them the same way (`kvfence serve`, the hub's router).
"""

from __future__ import annotations

import json
import sys

import click

from kvfence.serve.tenants import TenantRegistry


def announce(url: str, tenants: TenantRegistry, model: str, gate: str) -> None:
    """The lines a server prints once it listens: gate verdict, URL, keys, a curl to try."""
    click.echo(gate)
    click.echo(f"kvfence serving {model} at {url}  (OpenAI base URL: {url}/v1)")
    if tenants.auth == "none":
        click.echo("auth: none (dev mode, single tenant 'default')")
        key_header = ""
    else:
        for t in tenants.tenants:
            click.echo(f"tenant {t.name}: key {t.keys[0]}")
        if tenants.operator_keys:
            click.echo(
                f"operator key: {tenants.operator_keys[0]} (/metrics, pool usage, lab facts)"
            )
        else:
            click.echo("no operator key: /metrics and operator facts answer 403 to every key")
        key_header = f' -H "Authorization: Bearer {tenants.tenants[0].keys[0]}"'
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8})
    click.echo(
        f"try: curl -s {url}/v1/completions -H 'Content-Type: application/json'"
        f"{key_header} -d '{body}'"
    )
    sys.stdout.flush()
