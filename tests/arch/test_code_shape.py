"""No module over 400 lines and no function over 40 body lines, save the allow-list below.

The allow-list only shrinks: a new long function fails here, and so does an entry that is no
longer long (or no longer exists), so the list always says exactly what remains. Body lines
are counted as in bench/code_shape.py (first statement after the docstring to the last line).
"""

from __future__ import annotations

import sys
from pathlib import Path

import kvfence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.code_shape import LONG_FUNCTION, LONG_MODULE, functions  # noqa: E402

SRC = Path(kvfence.__file__).parent

# Modules still over 400 lines (none today: keep it so).
LONG_MODULES_ALLOWED: set[str] = set()

# "module:function" still over 40 body lines (none today: keep it so).
LONG_FUNCTIONS_ALLOWED: set[str] = set()


def long_modules(root: Path = SRC) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if len(p.read_text().splitlines()) > LONG_MODULE
    }


def long_functions(root: Path = SRC) -> set[str]:
    return {
        f"{f.module}:{f.name}"
        for p in root.rglob("*.py")
        for f in functions(p, root)
        if f.body_lines > LONG_FUNCTION
    }


def test_no_new_long_module() -> None:
    assert long_modules() - LONG_MODULES_ALLOWED == set()


def test_no_new_long_function() -> None:
    assert long_functions() - LONG_FUNCTIONS_ALLOWED == set()


def test_allow_lists_only_name_what_is_still_long() -> None:
    """Shrink the lists when a function or module is made short (or is gone)."""
    assert LONG_MODULES_ALLOWED - long_modules() == set()
    assert LONG_FUNCTIONS_ALLOWED - long_functions() == set()


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    """The check itself can fail: a 41-line function is reported, a 40-line one is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(40))
    (tmp_path / "m.py").write_text(
        f'def ok():\n    """Doc."""\n{body}\ndef bad():\n{body}    return 0\n'
    )
    assert long_functions(tmp_path) == {"m.py:bad"}
    (tmp_path / "big.py").write_text("x = 1\n" * (LONG_MODULE + 1))
    assert long_modules(tmp_path) == {"big.py"}
