"""The two tenants' keys: the cross-tenant probes need one of each or neither.

Every isolation probe is a pair: tenant A plants, tenant B looks. With one key the other
tenant's requests go without credentials, an engine with authentication refuses them
(401), and every probe that needs B came back "could not build the prompt". Neither key
is an engine without authentication, where both tenants' requests go bare.
"""

from __future__ import annotations


def second_key_missing(key_a: str | None, key_b: str | None) -> str | None:
    """What to pass when only one tenant's key is given; None when both or neither are."""
    if (key_a is None) == (key_b is None):
        return None
    given, flag, env = ("A", "--key-b", "KVFENCE_AUDIT_KEY_B")
    if key_a is None:
        given, flag, env = ("B", "--key-a", "KVFENCE_AUDIT_KEY_A")
    return (
        f"only tenant {given}'s key was given; the cross-tenant probes need a second tenant's "
        f"key: pass {flag} (or set {env}) with a key of another tenant"
    )
