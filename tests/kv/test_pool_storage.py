"""A pool that another process copies into by CMA lives on transparent huge pages.

UCX (under NIXL) copies into decode's pool with `process_vm_writev`, which pins the
target's pages one at a time: on 2 MiB pages it runs at memcpy's rate, on 4 KiB pages at
half (bench/transfer.py). The kernel marks a mapping advised for huge pages
`THPeligible: 1` in /proc/self/smaps, whether or not it has assembled one yet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool, host_storage
from kvfence.transfer.nixl import NixlTransport

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
PAGES = 256  # 4 MiB each of K and V: room for whole huge pages


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
    not THP.exists() or "[madvise]" not in THP.read_text(),
    reason="transparent huge pages are not in madvise mode on this kernel",
)
def test_nixls_decode_pool_is_on_huge_pages_and_other_pools_are_not() -> None:
    pool = NixlTransport().create_pool(GEOM, PAGES)
    assert thp_eligible(pool.k.data_ptr()) and thp_eligible(pool.v.data_ptr())
    assert not pool.k.any() and not pool.v.any()
    # The probe itself can fail: an ordinary pool of the same size is not advised.
    plain = KVPool(GEOM, PAGES)
    assert not thp_eligible(plain.k.data_ptr()) and not thp_eligible(plain.v.data_ptr())
