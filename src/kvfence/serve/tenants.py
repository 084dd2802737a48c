"""Tenants and their API keys (invariant I10).

Keys come from a JSON file (`{"tenants": [{"name": "a", "keys": ["sk-..."]}]}`,
each entry optionally with admission `"limits"`: see `serve/limits.py`)
or are generated for the embedded default. A presented key is compared in
constant time against *every* key, always all of them, with no early exit, so
the time taken says nothing about which key (or which prefix of a key)
matched. Running without keys is an explicit dev mode: one tenant, "default",
reported as `auth: "none"` in /server_info.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvfence.serve.limits import TenantLimits

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MIN_KEY_CHARS = 16
DEV_TENANT = "default"


class TenantFileError(ValueError):
    """A tenants file that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    keys: tuple[str, ...]
    limits: TenantLimits = field(default_factory=TenantLimits)


@dataclass(frozen=True, slots=True)
class TenantRegistry:
    tenants: tuple[Tenant, ...]
    auth: Literal["api-key", "none"] = "api-key"

    def __post_init__(self) -> None:
        if self.auth == "none":
            if [t.name for t in self.tenants] != [DEV_TENANT]:
                raise ValueError("dev mode (no auth) has exactly one tenant, 'default'")
            return
        if not self.tenants:
            raise ValueError("api-key auth needs at least one tenant")
        names, keys = set(), set()
        for t in self.tenants:
            if not NAME_RE.match(t.name):
                raise ValueError(
                    f"tenant name {t.name!r} must match {NAME_RE.pattern} (letters, digits, _ . -)"
                )
            if t.name in names:
                raise ValueError(f"tenant {t.name!r} is listed twice")
            names.add(t.name)
            if not t.keys:
                raise ValueError(f"tenant {t.name!r} has no keys")
            for k in t.keys:
                if len(k) < MIN_KEY_CHARS or not k.isascii() or not k.isprintable() or " " in k:
                    raise ValueError(
                        f"a key of tenant {t.name!r} must be >= {MIN_KEY_CHARS} printable ASCII "
                        "characters without spaces"
                    )
                if k in keys:
                    # One key for two tenants would make the tenant ambiguous.
                    raise ValueError(f"a key of tenant {t.name!r} is also used by another entry")
                keys.add(k)

    @classmethod
    def dev(cls) -> TenantRegistry:
        return cls(tenants=(Tenant(DEV_TENANT, ()),), auth="none")

    @classmethod
    def generate(cls, names: tuple[str, ...] = ("tenant-a", "tenant-b")) -> TenantRegistry:
        return cls(tenants=tuple(Tenant(n, (f"sk-kvf-{secrets.token_hex(16)}",)) for n in names))

    @classmethod
    def from_file(cls, path: str | Path) -> TenantRegistry:
        path = Path(path)
        try:
            data: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TenantFileError(f"cannot read tenants file {path}: {e}") from None
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, list) or set(data) != {"tenants"}:
            raise TenantFileError(
                f'{path}: expected {{"tenants": [{{"name": ..., "keys": [...]}}]}}'
            )
        tenants = []
        for i, entry in enumerate(entries):
            if (
                not isinstance(entry, dict)
                or not {"name", "keys"} <= set(entry) <= {"name", "keys", "limits"}
                or not isinstance(entry["name"], str)
                or not isinstance(entry["keys"], list)
                or not all(isinstance(k, str) for k in entry["keys"])
            ):
                raise TenantFileError(
                    f"{path}: tenants[{i}] must be {{'name': str, 'keys': [str, ...]}} "
                    "(and optionally 'limits')"
                )
            try:
                limits = TenantLimits.from_json(entry.get("limits", {}))
            except (TypeError, ValueError) as e:
                raise TenantFileError(f"{path}: tenants[{i}]: {e}") from None
            tenants.append(Tenant(entry["name"], tuple(entry["keys"]), limits))
        try:
            return cls(tenants=tuple(tenants))
        except ValueError as err:
            raise TenantFileError(f"{path}: {err}") from None

    def to_json(self) -> str:
        return json.dumps({"tenants": [_entry(t) for t in self.tenants]}, indent=2)

    def limits(self) -> dict[str, TenantLimits]:
        return {t.name: t.limits for t in self.tenants}

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant for an `Authorization: Bearer <key>` header, or None (I10)."""
        if self.auth == "none":
            return DEV_TENANT
        presented = _bearer(authorization)
        if presented is None:
            return None
        probe = presented.encode("utf-8", "surrogateescape")
        found: str | None = None
        # Every key is compared, matched or not: no early exit (I10).
        for tenant in self.tenants:
            for key in tenant.keys:
                if hmac.compare_digest(probe, key.encode("ascii")):
                    found = tenant.name
        return found


def _entry(t: Tenant) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": t.name, "keys": list(t.keys)}
    if not t.limits.unlimited:
        entry["limits"] = t.limits.to_json()
    return entry


def _bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
