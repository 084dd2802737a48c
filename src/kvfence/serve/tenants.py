"""Tenants and their API keys (invariant I10).

Keys come from a JSON file (`{"tenants": [{"name": "a", "keys": ["sk-..."]}]}`,
each entry optionally with admission `"limits"`: see `serve/limits.py`; an entry
without them gets the server's default limits, `"limits": "unlimited"` none)
or are generated for the embedded default. A presented key is compared in
constant time against *every* key, always all of them, with no early exit, so
the time taken says nothing about which key (or which prefix of a key)
matched. Running without keys is an explicit dev mode: one tenant, "default",
reported as `auth: "none"` in /server_info.

Operator keys (`"operator_keys": [...]` in the file, or `--operator-key`) are
a separate credential for operator data — /metrics, live pool usage, lab
facts, anything aggregated across tenants. An operator key is no tenant key
(it cannot generate), and a tenant key never reads operator data (I10).
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
from dataclasses import dataclass, field, replace
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
    operator_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.auth == "none":
            if [t.name for t in self.tenants] != [DEV_TENANT] or self.operator_keys:
                raise ValueError(
                    "dev mode (no auth) has exactly one tenant, 'default', and no operator keys"
                )
            return
        if not self.tenants:
            raise ValueError("api-key auth needs at least one tenant")
        names: set[str] = set()
        keys: set[str] = set()
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
                _check_key(k, f"tenant {t.name!r}", keys)
        for k in self.operator_keys:
            _check_key(k, "the operator", keys)

    @classmethod
    def dev(cls) -> TenantRegistry:
        # One tenant has no neighbour to protect: the dev mode is unlimited.
        return cls(tenants=(Tenant(DEV_TENANT, (), TenantLimits.unlimited()),), auth="none")

    @classmethod
    def generate(cls, names: tuple[str, ...] = ("tenant-a", "tenant-b")) -> TenantRegistry:
        return cls(
            tenants=tuple(Tenant(n, (f"sk-kvf-{secrets.token_hex(16)}",)) for n in names),
            operator_keys=(f"sk-kvf-op-{secrets.token_hex(16)}",),
        )

    def without_default_limits(self) -> TenantRegistry:
        """The operator's explicit choice: every bound left to the default becomes unbounded."""
        unbounded = TenantLimits.unlimited()
        tenants = tuple(replace(t, limits=t.limits.resolve(unbounded)) for t in self.tenants)
        return replace(self, tenants=tenants)

    def with_operator_keys(self, keys: tuple[str, ...]) -> TenantRegistry:
        """The same tenants with these operator keys added (validated like any key)."""
        return replace(self, operator_keys=self.operator_keys + tuple(keys))

    @classmethod
    def from_file(cls, path: str | Path) -> TenantRegistry:
        path = Path(path)
        try:
            data: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TenantFileError(f"cannot read tenants file {path}: {e}") from None
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not set(data) <= {"tenants", "operator_keys"}:
            raise TenantFileError(
                f'{path}: expected {{"tenants": [{{"name": ..., "keys": [...]}}]}} '
                '(and optionally "operator_keys": [...])'
            )
        operators = data.get("operator_keys", [])
        if not isinstance(operators, list) or not all(isinstance(k, str) for k in operators):
            raise TenantFileError(f"{path}: operator_keys must be a list of strings")
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
                limits = TenantLimits.from_json(entry.get("limits", {}))  # absent: defaults
            except (TypeError, ValueError) as e:
                raise TenantFileError(f"{path}: tenants[{i}]: {e}") from None
            tenants.append(Tenant(entry["name"], tuple(entry["keys"]), limits))
        try:
            return cls(tenants=tuple(tenants), operator_keys=tuple(operators))
        except ValueError as err:
            raise TenantFileError(f"{path}: {err}") from None

    def to_json(self) -> str:
        data: dict[str, Any] = {"tenants": [_entry(t) for t in self.tenants]}
        if self.operator_keys:
            data["operator_keys"] = list(self.operator_keys)
        return json.dumps(data, indent=2)

    def is_operator(self, authorization: str | None) -> bool:
        """Whether the header carries an operator key (dev mode: everyone is the operator)."""
        if self.auth == "none":
            return True
        presented = _bearer(authorization)
        if presented is None:
            return False
        probe = presented.encode("utf-8", "surrogateescape")
        found = False
        for key in self.operator_keys:  # all of them, no early exit (I10)
            found |= hmac.compare_digest(probe, key.encode("ascii"))
        return found

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


def _check_key(key: str, owner: str, seen: set[str]) -> None:
    if len(key) < MIN_KEY_CHARS or not key.isascii() or not key.isprintable() or " " in key:
        raise ValueError(
            f"a key of {owner} must be >= {MIN_KEY_CHARS} printable ASCII characters without spaces"
        )
    if key in seen:
        # One key for two owners would make the owner ambiguous.
        raise ValueError(f"a key of {owner} is also used by another entry")
    seen.add(key)


def _entry(t: Tenant) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": t.name, "keys": list(t.keys)}
    if not t.limits.is_default:
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
