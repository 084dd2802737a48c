"""A CPU pool's K/V storage: zeroed, resident, and advised onto transparent huge pages.

Huge pages are what let a process-to-process copy (UCX's CMA, under NIXL) into the
pool run at memcpy's rate (bench/transfer.py); the kernel marks a mapping advised
for them `THPeligible: 1` in /proc/self/smaps, whether or not it has assembled one yet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool, host_storage

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` is eligible for transparent huge pages."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping in /proc/self/smaps holds {address:#x}")


def test_host_storage_is_zero_with_the_shape_and_dtype_asked_for() -> None:
    t = host_storage((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t.fill_(1)  # writable, and a second pool is not the first one's memory
    assert not host_storage((3, 5, 7), torch.bfloat16).any()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off on this kernel",
)
def test_a_cpu_pools_storage_is_advised_onto_huge_pages() -> None:
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    pool = KVPool(geometry, 256)  # 4 MiB each of K and V: room for whole huge pages
    assert thp_eligible(pool.k.data_ptr()) and thp_eligible(pool.v.data_ptr())
    assert not pool.k.any() and not pool.v.any()
    if "[madvise]" in THP.read_text():
        # The probe itself can fail: here an ordinary heap tensor of that size is not advised.
        assert not thp_eligible(torch.zeros(pool.k.shape, dtype=pool.k.dtype).data_ptr())
