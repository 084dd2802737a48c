"""Which optional install (`pip install 'kvfence[EXTRA]'`) brings which third-party module.

The base install carries the audit, the gate, the guard and `lab list`: HTTP, statistics
and reports. Everything that runs kvfence's own engine comes with an extra. A command that
reaches an engine module without it answers with the one line `hint` builds, exit 2, never
a traceback. It imports nothing beyond the base install: it runs exactly where the extras'
modules are missing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import MappingProxyType
from typing import NoReturn

import click

# The top-level import names of each extra's distributions (pyproject.toml lists the
# distributions; tests/install checks the two lists agree).
EXTRA_MODULES = MappingProxyType(
    {
        "serve": (
            "torch",
            "safetensors",
            "tokenizers",
            "jinja2",
            "xxhash",
            "starlette",
            "uvicorn",
            "zmq",
        ),
        "pd": ("sglang_router", "mooncake"),
    }
)

# Exit status of a command that cannot run in this install: click's usage-error code,
# distinct from a verdict's 1 (fail).
MISSING_EXTRA_EXIT = 2


@dataclass(frozen=True, slots=True)
class MissingExtra:
    """A module this install lacks, and the extra that provides it."""

    module: str
    extra: str

    def hint(self, what: str) -> str:
        return (
            f"{what} needs kvfence's engine, which this install lacks ({self.module} is not "
            f"installed): pip install 'kvfence[{self.extra}]'"
        )


def extra_for(module: str) -> str | None:
    """The extra that installs top-level module `module`, or None if no extra does."""
    root = module.partition(".")[0]
    return next((extra for extra, mods in EXTRA_MODULES.items() if root in mods), None)


def missing_extra(error: ModuleNotFoundError) -> MissingExtra | None:
    """What `error` says is missing, when it is an extra's module that is truly not installed.

    A module that is installed but failed to import for another reason (a broken native
    library, a missing submodule) is not an install's choice: None, so the error surfaces.
    """
    name = error.name or ""
    root = name.partition(".")[0]
    extra = extra_for(root)
    if extra is None or importlib.util.find_spec(root) is not None:
        return None
    return MissingExtra(root, extra)


def engine_missing() -> MissingExtra | None:
    """The first of the `serve` extra's modules this install lacks, or None if it has them all."""
    for module in EXTRA_MODULES["serve"]:
        if importlib.util.find_spec(module) is None:
            return MissingExtra(module, "serve")
    return None


def exit_if_missing_extra(ctx: click.Context, error: ModuleNotFoundError, what: str) -> NoReturn:
    """Exit 2 with the install hint when `error` is an extra's absent module; else re-raise it."""
    missing = missing_extra(error)
    if missing is None:
        raise error
    click.echo(missing.hint(what), err=True)
    ctx.exit(MISSING_EXTRA_EXIT)
