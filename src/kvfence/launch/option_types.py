"""The click types of `kvfence serve`'s options: each converts its flag to the typed value
`ServeOptions` holds, and a bad value is a usage error naming the flag and what it takes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import click

from kvfence.faults import FaultSet


@dataclass(frozen=True, slots=True)
class PerRole:
    """A value given per role (`--kv-pages`, `--kv-bytes`); None: that role's default."""

    prefill: int | None = None
    decode: int | None = None

    def of(self, role: str) -> int | None:
        """This role's value: `role` is "prefill" or "decode"."""
        return self.prefill if role == "prefill" else self.decode

    def __str__(self) -> str:  # as the flag takes it, for a child's argv
        if self.prefill == self.decode and self.prefill is not None:
            return str(self.prefill)
        given = (f"{r}={n}" for r, n in (("prefill", self.prefill), ("decode", self.decode)))
        return ",".join(g for g in given if not g.endswith("=None"))


class EnumChoice(click.Choice[str]):
    """A choice among an enum's values, converted to the member (`--scrub on-free` is
    `ScrubPolicy.ON_FREE` from the parser on)."""

    def __init__(self, enum_type: type[enum.Enum]) -> None:
        super().__init__([m.value for m in enum_type])
        self.enum_type = enum_type

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> Any:
        if isinstance(value, self.enum_type):
            return value
        return self.enum_type(super().convert(value, param, ctx))


class PerRoleType(click.ParamType):
    """`N` (both roles) or `prefill=N,decode=M`, each a positive integer."""

    name = "per-role"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> Any:
        if isinstance(value, PerRole):
            return value
        text = str(value)
        try:
            if "=" not in text:
                n = int(text)
                values = {"prefill": n, "decode": n}
            else:
                values = {k: int(v) for k, v in (p.split("=", 1) for p in text.split(","))}
            if not set(values) <= {"prefill", "decode"} or min(values.values()) < 1:
                raise ValueError
        except ValueError:
            self.fail(f"{text!r}: give N (both roles) or prefill=N,decode=M, each >= 1", param, ctx)
        return PerRole(values.get("prefill"), values.get("decode"))


PER_ROLE = PerRoleType()


def parse_faults(_ctx: click.Context, _param: click.Parameter, names: tuple[str, ...]) -> FaultSet:
    """`--lab-fault`, repeatable: the switches, each a known one (the error lists them)."""
    try:
        return FaultSet.parse(names)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--lab-fault") from None
