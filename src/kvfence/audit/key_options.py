"""The credential options every command that probes an engine takes (`audit`, `watch`,
`gate --target`), each also read from its environment variable, as a CI job passes secrets."""

from __future__ import annotations

import click

key_a_option = click.option(
    "--key-a", envvar="KVFENCE_AUDIT_KEY_A", show_envvar=True, default=None,
    help="tenant A's API key",
)  # fmt: skip
key_b_option = click.option(
    "--key-b", envvar="KVFENCE_AUDIT_KEY_B", show_envvar=True, default=None,
    help="tenant B's API key",
)  # fmt: skip
operator_key_option = click.option(
    "--operator-key", envvar="KVFENCE_AUDIT_OPERATOR_KEY", show_envvar=True, default=None,
    help="reads /metrics and /server_info (operator data on kvfence)",
)  # fmt: skip
