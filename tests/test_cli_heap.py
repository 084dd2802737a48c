"""The CLI makes glibc keep freed heap memory mapped (cli.keep_freed_heap), unless the user chose.

Each case runs in a fresh interpreter: malloc's thresholds are process-wide. What
is checked is malloc's own accounting (mallinfo2): with the setting a 4 MiB block
comes from the heap and stays mapped after free; without it, glibc mmaps it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfence import cli

PROBE = """
import ctypes, sys
from kvfence.cli import keep_freed_heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
before = libc.mallinfo2()
block = libc.malloc(4 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(kept, during.hblkhd - before.hblkhd, after.arena >= 4 << 20)
"""

glibc = pytest.mark.skipif(
    not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"), reason="glibc's malloc only"
)


def _probe(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


@glibc
def test_blocks_come_from_the_heap_and_stay_mapped_after_free() -> None:
    assert _probe("keep") == ["True", "0", "True"]


@glibc
def test_without_it_glibc_maps_the_block_and_the_probe_sees_it() -> None:
    kept, mapped, _ = _probe("default")
    assert kept == "None" and int(mapped) >= 4 << 20


@glibc
@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    ],
)
def test_a_users_own_malloc_setting_is_left_as_it_is(env: dict[str, str]) -> None:
    kept, mapped, _ = _probe("keep", **env)
    assert kept == "False" and int(mapped) >= 4 << 20


def test_every_lazy_command_sets_it_before_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cli, "keep_freed_heap", lambda: calls.append("heap") or True)
    for name in ("serve", "audit"):
        cli._LAZY_COMMANDS[name].load()
    assert calls == ["heap", "heap"]
