"""Named targets: `--target NAME=URL` (a bare URL names itself).

Every report shows a target by its name, so two engines on loopback read as
"incident lab" and "hardened" instead of two port numbers. The JUnit file
gives each target its own `classname`: CI parsers key a case by classname and
name (GitLab keeps one case per key), so targets with one classname would
overwrite each other's cases.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

URL_SCHEMES = ("http://", "https://")
# Characters a JUnit classname keeps; the rest become "_" (Jenkins splits classnames at dots
# into packages, so a URL's dots would nest one target in folders).
_CLASSNAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class TargetSpecError(ValueError):
    """A `--target` value that is neither a URL nor NAME=URL, or a name given twice."""


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """One engine to audit: its base URL and the name the reports show.

    `engine_known_by`: when the caller knows the engine (the embedded default starts it), how
    it knows, shown where a report says how the engine was identified; None: the run's
    `--engine` (given, or "auto" detection) decides."""

    name: str
    url: str
    engine_known_by: str | None = None


def parse_target(text: str) -> TargetSpec:
    """`URL` or `NAME=URL`; the URL must be http(s). A bare URL is its own name."""
    value = text.strip()
    if value.startswith(URL_SCHEMES):
        return TargetSpec(value.rstrip("/"), value.rstrip("/"))
    name, sep, url = value.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url.startswith(URL_SCHEMES):
        raise TargetSpecError(
            f"--target {text!r} is neither an http(s) URL nor NAME=URL "
            "(e.g. --target prod-prefill=http://10.0.0.5:8000)"
        )
    return TargetSpec(name, url.rstrip("/"))


def named_targets(texts: Iterable[str]) -> tuple[TargetSpec, ...]:
    """Every `--target` value parsed; names must differ (the reports tell targets apart by them)."""
    specs = tuple(parse_target(t) for t in texts)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise TargetSpecError(f"two --target values are named {spec.name!r}; names must differ")
        seen.add(spec.name)
    return specs


def as_specs(targets: Sequence[str | TargetSpec]) -> tuple[TargetSpec, ...]:
    """Plain URLs (the library's callers) become specs named by their URL."""
    return tuple(t if isinstance(t, TargetSpec) else TargetSpec(t, t) for t in targets)


def junit_classnames(names: Sequence[str]) -> dict[str, str]:
    """A distinct JUnit classname per target name: `kvfence.audit.<name, dots and spaces as _>`,
    with a number appended where two names would otherwise meet (e.g. "a b" and "a_b")."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for name in names:
        stem = "kvfence.audit." + (_CLASSNAME_UNSAFE.sub("_", name).strip("_") or "target")
        candidate, n = stem, 1
        while candidate in taken:
            n += 1
            candidate = f"{stem}_{n}"
        taken.add(candidate)
        out[name] = candidate
    return out
