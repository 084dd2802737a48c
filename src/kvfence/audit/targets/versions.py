"""An engine's stated version, and whether the audit knows that version's rules.

Each adapter decides what a pool figure means by the rules read in the
source of the engine versions named in its `ReadRange`. A version outside
that range is not assumed to keep them: a figure whose meaning is not known
for the version in front of the audit must never pass the capacity gate, so
the adapter reports the pool as unknown and says which version and why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvfence.audit.base import Fact

Version = tuple[int, ...]


def parse_version(text: object) -> Version | None:
    """(major, minor, patch) from a version string ("0.32.0", "v3.3.7", "0.33.1.dev4+g1a2b",
    "0.32.0+cpu"); None when it holds no number. Local and dev suffixes do not count: the rules
    follow the release a build was cut from."""
    if not isinstance(text, str):
        return None
    nums = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(n) for n in nums) if nums else None


def show(version: Version | None) -> str:
    return ".".join(map(str, version)) if version else "unknown"


@dataclass(frozen=True, slots=True)
class ReadRange:
    """The versions of one engine whose source the adapter's rules were read in.

    `lowest` and `highest` are compared on `depth` leading numbers: (0, 32) .. (0, 33) holds
    every 0.32.x and 0.33.x release; depth 3 pins exact patch releases.
    """

    engine: str
    lowest: Version
    highest: Version
    depth: int = 2

    def covers(self, version: Version) -> bool:
        key = version[: self.depth]
        return self.lowest[: self.depth] <= key <= self.highest[: self.depth]

    def named(self) -> str:
        low, high = show(self.lowest[: self.depth]), show(self.highest[: self.depth])
        return f"{self.engine} {low}" if low == high else f"{self.engine} {low} to {high}"

    def unknown_rules(self, version: Version | None, stated: Fact, figure: str) -> str | None:
        """Why `figure` cannot be read by this range's rules for `version`; None when it can."""
        if version is None:
            return f"{self.engine} {said(stated)}, so the rules for {figure} cannot be chosen"
        if self.covers(version):
            return None
        side = "newer" if version[: self.depth] > self.highest[: self.depth] else "older"
        return (
            f"{self.engine} {show(version)} is {side} than the versions whose source these "
            f"rules were read in ({self.named()}): what {figure} means there is not known to "
            "this audit, so the gate cannot pass on it"
        )


def said(stated: Fact) -> str:
    """What the engine said about its version, when it gave no release number."""
    if stated.known:
        return f"states version {stated.value!r} ({stated.source}), which names no release"
    return f"did not state its version ({stated.source}: {stated.note or 'absent'})"


def version_fact(raw: object, source: str, why_absent: str = "absent") -> Fact:
    """The version as the engine states it (the string unchanged), or unknown with why."""
    if isinstance(raw, str) and raw.strip():
        return Fact(raw.strip(), source)
    return Fact.unknown(source, why_absent)
