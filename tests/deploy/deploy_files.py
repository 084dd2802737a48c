"""What the deploy tests read from deploy/: the manifests as documents, and every `kvfence`
command line an artefact runs, checked against the CLI itself."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import yaml

from kvfence.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "prometheus" / "kvfence-rules.yml"


def documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a manifest file."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) for d in documents(p)]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in k8s_objects() if d["kind"] == kind]


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def gate_probe(deployment: dict[str, Any]) -> list[str]:
    """The kvfence-gate sidecar's readiness command."""
    (gate,) = (c for c in containers(deployment) if c["name"] == "kvfence-gate")
    return list(gate["readinessProbe"]["exec"]["command"])


@dataclass(frozen=True, slots=True)
class Parsed:
    path: tuple[str, ...]  # the subcommands, e.g. ("audit",)
    params: dict[str, Any]  # what click parsed, by parameter name


def parse_kvfence(argv: list[str]) -> Parsed:
    """Parse `kvfence ...` as the CLI would, without running it: an unknown command, an
    unknown flag, a missing required option or a value of the wrong type raises
    click.UsageError (or a subclass)."""
    if not argv or Path(argv[0]).name != "kvfence":
        raise click.UsageError(f"not a kvfence command: {argv}")
    command: click.Command = main
    names: list[str] = []
    rest = argv[1:]
    parent: click.Context | None = None
    while True:
        ctx = command.make_context(names[-1] if names else "kvfence", list(rest), parent=parent)
        left = _unparsed(ctx) if isinstance(command, click.Group) else []
        if not left:
            return Parsed(tuple(names), dict(ctx.params))
        sub_name, *rest = left
        sub = command.get_command(ctx, sub_name)
        if sub is None:
            raise click.UsageError(f"no such command: kvfence {' '.join([*names, sub_name])}")
        command, parent = sub, ctx
        names.append(sub_name)


def _unparsed(ctx: click.Context) -> list[str]:
    """A group's tokens after its own options: the subcommand and its arguments. Click 8.2
    to 8.x keep the subcommand's name in `protected_args`, deprecated for 9.0 (where `args`
    holds them all); reading it warns, which pytest makes an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        protected = list(getattr(ctx, "protected_args", []))
    return [*protected, *ctx.args]


def kvfence_lines(script: str) -> Iterator[str]:
    """The `kvfence ...` lines of a shell script, backslash continuations joined."""
    for line in script.replace("\\\n", " ").splitlines():
        if line.strip().startswith("kvfence "):
            yield line.strip()


def envvars_of(*names: str) -> set[str]:
    """The environment variables `kvfence NAMES...` reads its options from."""
    command: click.Command = main
    ctx = click.Context(main)
    for name in names:
        assert isinstance(command, click.Group), names
        sub = command.get_command(ctx, name)
        assert sub is not None, names
        command = sub
    return {p.envvar for p in command.params if isinstance(p.envvar, str)}
