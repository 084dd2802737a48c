"""Building the C++ kernels (`model/csrc`): at install by `make`, else on first use.

The kernels are compiled for the machine that runs them (`-march=native`), so a wheel cannot
carry them: a wheel built on one CPU could stop another with an illegal instruction. The
wheel carries the sources; the first engine start on a machine builds the library (about
10 s) into the first writable of `$KVFENCE_EXT_DIR`, `<prefix>/share/kvfence` or
`$KVFENCE_CACHE/ext` (default `~/.cache/kvfence/ext`), named by a hash of the sources and
flags so a stale build is never loaded. A file lock makes the workers of one stack, which
start together, build it once: the others wait and load it. Without a compiler the engine
runs on torch alone and the log says what to install. Torch-free, like the build itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / n
    for n in (
        "paged_decode.cpp",
        "paged_prefill.cpp",
        "small_linear.cpp",
        "spin_pool.cpp",
        "rows.cpp",
        "decode_layers.cpp",
        "step_checks.cpp",
    )
)
HEADERS = (CSRC / "spin_pool.h", CSRC / "vec.h")
# OpenMP only for `omp simd`: the kernels' threads are spin_pool's, not libgomp's.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-pthread", "-shared", "-fPIC", "-std=c++17")


class KernelBuildError(RuntimeError):
    """The kernels could not be built here; the message says what to install or set."""


def library_name() -> str:
    """The library's file name for these sources and these flags."""
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(FLAGS).encode()
    return f"kvfence_paged_{hashlib.sha256(text).hexdigest()[:12]}.so"


def ext_dirs() -> tuple[Path, ...]:
    """Where the library may live, in the order it is looked for and built."""
    if env := os.environ.get("KVFENCE_EXT_DIR"):
        return (Path(env),)
    cache = os.environ.get("KVFENCE_CACHE") or Path.home() / ".cache" / "kvfence"
    return (Path(sys.prefix) / "share" / "kvfence", Path(cache) / "ext")


def _writable(directory: Path) -> bool:
    """Whether `directory` exists writable, or could be made under a writable ancestor."""
    for d in (directory, *directory.parents):
        if d.exists():
            return d.is_dir() and os.access(d, os.W_OK | os.X_OK)
    return False


def library_path() -> Path:
    """The built library for these sources, else where it would be built."""
    name = library_name()
    dirs = ext_dirs()
    built = next((d / name for d in dirs if (d / name).exists()), None)
    return built or next((d / name for d in dirs if _writable(d)), dirs[0] / name)


def build() -> Path:
    """Compile the library unless it is built (seconds); KernelBuildError says what is missing."""
    out = library_path()
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise KernelBuildError(
            "no C++ compiler found: install g++ (Debian/Ubuntu: apt-get install g++) or set CXX"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with (out.parent / f"{out.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then find it built
            if not out.exists():
                _compile(cxx, out)
    except OSError as e:
        raise KernelBuildError(
            f"cannot write {out.parent} ({e.strerror}): set KVFENCE_EXT_DIR"
        ) from e
    return out


def _compile(cxx: str, out: Path) -> None:
    log.warning("building kvfence's C++ kernels once for this machine (about 10 s): %s", out)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        done = subprocess.run(
            [cxx, *FLAGS, *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True
        )
    except OSError as e:  # CXX names no program
        raise KernelBuildError(f"cannot run the compiler {cxx} ({e.strerror}): set CXX") from e
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        first_error = next((ln for ln in lines if "error" in ln), lines[-1])
        raise KernelBuildError(f"{cxx} failed (exit {done.returncode}): {first_error}")
    tmp.replace(out)  # atomic: a loader without the lock sees no library or the whole one
