"""A serving process makes glibc keep freed heap memory mapped (serve/process_tuning.py), and
OpenMP waits passive, unless the user chose; `kvfence serve` does both before torch loads.

Each case runs in a fresh interpreter: malloc's thresholds are process-wide. What
is checked is malloc's own accounting (mallinfo2): with the setting a 4 MiB block
comes from the heap and stays mapped after free; without it, glibc mmaps it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import ctypes, sys
from kvfence.serve.process_tuning import keep_freed_heap
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


# Runs `kvfence serve` in a fresh interpreter whose torch is missing: the first import of
# torch records the settings as they were then, and fails, which ends the command.
# libgomp reads OMP_WAIT_POLICY only when torch loads it.
SERVE_PROBE = """
import importlib.abc, os, sys
import kvfence.serve.process_tuning as tuning
seen = {"heap": False}
real_keep = tuning.keep_freed_heap
def keep():
    seen["heap"] = True
    return real_keep()
tuning.keep_freed_heap = keep
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            seen.setdefault("at_torch", (os.environ.get("OMP_WAIT_POLICY"), seen["heap"]))
            raise ModuleNotFoundError("no torch in this probe", name="torch")
        return None
sys.meta_path.insert(0, NoTorch())
from kvfence.cli import main
try:
    main(sys.argv[1:])
except BaseException as e:  # the command ends on the missing torch, however it reports it
    print("ENDED", type(e).__name__)
print("AT_TORCH", seen.get("at_torch"))
"""


def test_serve_tunes_the_process_before_torch_loads(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    argv = ["serve", "--model", str(tmp_path / "none"), "--model-kind", "mirror"]
    out = subprocess.run(
        [sys.executable, "-c", SERVE_PROBE, *argv],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "ENDED" in out, out
    assert "AT_TORCH ('PASSIVE', True)" in out, out
