"""The router child's entry: the RouterSpec its supervisor built, validated, then the role.

    python -m kvfence.hub.router_entry SPEC.json

`kvfence serve --disaggregated` writes the router's spec (serve/specs.py) beside the
workers' and starts the router with this entry, as it starts each worker with
`worker_entry.py`. A spec that does not validate, or a tenant registry that cannot be read,
ends the router with exit code 2 and the reason, before it binds or loads the web stack.
`kvfence serve --role router` builds the same spec from its options and runs the same
`run_router`.
"""

from __future__ import annotations

import sys

from kvfence.serve.specs import EXIT_BAD_SPEC, RouterSpec, SpecError, spec_from_argv
from kvfence.serve.tenants import TenantFileError, TenantRegistry


def tenants_of(spec: RouterSpec) -> TenantRegistry:
    """The child's tenants: its registry file, or the keyless dev tenant (`no_auth`)."""
    if spec.no_auth:
        return TenantRegistry.dev()
    if spec.tenants_file is None:
        raise SpecError("a router child's spec names its tenants_file, or sets no_auth")
    try:
        return TenantRegistry.from_file(spec.tenants_file)
    except TenantFileError as e:
        raise SpecError(f"bad router spec: RouterSpec.tenants_file: {e}") from None


def main(argv: list[str]) -> int:
    try:
        spec = spec_from_argv(RouterSpec, argv)
        tenants = tenants_of(spec)
    except SpecError as e:
        print(f"kvfence router: {e}", file=sys.stderr)
        return EXIT_BAD_SPEC
    from kvfence.serve.startup import collector_paused

    with collector_paused():  # start-up imports (serve/startup.py)
        from kvfence.hub.router_role import run_router  # the web stack: past validation

    return run_router(spec, tenants)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
