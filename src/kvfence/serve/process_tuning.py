"""Process-wide tuning for a process that runs kvfence's engine: OpenMP waits and glibc's malloc.

Both are read by the libraries once (libgomp when torch loads it, malloc's thresholds on its
next allocation), so `tune_serving_process()` runs first thing in the entry point that
serves, before that entry imports torch. A user's own setting of either is left as it is.
Torch-free: `kvfence` imports it to tune the lab, whose replay and matrix run the engine
in-process, before the lab's modules load.
"""

from __future__ import annotations

import os


def quiet_openmp_waits() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT).

    libgomp reads it once, when torch loads it, so it is set before anything imports torch.
    libgomp's default spins ~3 ms without yielding after every parallel region: on a shared
    machine those threads hold the cores another process, or the thread they wait for, needs (bench/threads.py, 2 cores, load 5: 1.9x the throughput PASSIVE). The decode
    kernels do not wait on libgomp at all (model/csrc/spin_pool.h); what is left on it are
    torch's own ops, prefill's matrix products above all, whose regions are long enough
    that a sleeping wait costs little (bench/openmp_waits.py).
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


# mallopt(3) parameters (malloc.h) and the values kvfence sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_ABOVE_BYTES = 32 << 20  # glibc's own ceiling for its moving threshold (64-bit)
KEEP_FREED_BYTES = 1 << 30  # free heap memory kept mapped before glibc trims it


def keep_freed_heap() -> bool:
    """Make glibc's malloc keep freed heap memory mapped; True if it was set here.

    A forward step allocates and frees its activations, megabytes each. glibc hands
    freed memory at the top of a heap back to the kernel (`trim_threshold`), and the
    engine thread's arena does so after nearly every step, so the next step faults
    every page of its activations in again, zero-filled: 5,000-17,000 minor faults a
    request in `kvfence serve` (a 288-token prompt, smollm geometry), 15-25 ms of its
    TTFT. Setting the trim threshold alone also fixes glibc's otherwise moving mmap
    threshold at its 128 KiB start (then every activation is an mmap: 60,000 faults a
    request), so both are set: blocks under 32 MiB come from the heap, and up to 1 GiB
    of freed heap stays mapped (a server's peak of activations, not its KV pool, which
    is one allocation above the threshold). A user's own MALLOC_* or glibc.malloc
    tunables are left as they are; other C libraries are not touched.
    """
    if any(k in os.environ for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")) or (
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    ):
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
    except (AttributeError, ValueError, OSError):
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_ABOVE_BYTES) == 1
    return mmap_ok and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1


def tune_serving_process() -> None:
    """Both settings, for the engine this process is about to run."""
    quiet_openmp_waits()  # before torch (and its libgomp) is imported
    keep_freed_heap()  # before the engine's first large allocation
