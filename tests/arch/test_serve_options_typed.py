"""`kvfence serve`'s options travel as one typed value (launch/options.py), never as click's
parameter dict: no module of `serve/` reads an option by its name in a dict.

`ServeOptions(**ctx.params)` in launch/cli.py is the one hand-over; a `params["…"]` read, or
a context's `.params` taken anywhere else, is an option that skipped the types and the
checks (tests/serve/test_serve_options.py holds every option to a field).
"""

from __future__ import annotations

import re
from pathlib import Path

import kvfence

SERVE = Path(kvfence.__file__).parent / "serve"

# A dict of options read by name, or click's parameter dict taken from a context.
UNTYPED = re.compile(r"""params\s*\[\s*["']|params\.get\(|get_current_context\(\)\.params""")


def untyped_reads(root: Path = SERVE) -> list[str]:
    return [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if UNTYPED.search(line)
    ]


def test_no_serve_option_is_read_from_a_dict() -> None:
    assert untyped_reads() == []
