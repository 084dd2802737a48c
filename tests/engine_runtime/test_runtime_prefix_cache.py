"""Prefix cache namespaced by tenant and cache_salt (I8): hits inside a namespace, misses across."""

from __future__ import annotations

import pytest
from runtime_helpers import PAGE, Models, assert_quiet_and_empty, greedy, run, submit, work

from kvfence.engine.prefix_cache import PrefixCache
from kvfence.faults import Fault, FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool

PROMPT = list(
    range(40, 104)
)  # 64 tokens = 4 full pages; at most 3 are reused (one must be computed)
REUSABLE = 3 * PAGE


def cached_after(
    models: Models, first: str, second: str, faults: FaultSet | None = None, **kw: object
) -> int:
    """cached_tokens of the second request, after a first one in namespace `first`."""
    pipe = models.pipeline(faults=faults, **kw)
    (a,) = run(pipe, [work("a", first.split(":")[0], PROMPT, greedy(4), namespace=first)])
    (b,) = run(
        pipe, [work("b", second.split(":")[0], PROMPT, greedy(len(PROMPT)), namespace=second)]
    )
    assert a.cached_tokens == 0
    assert b.error is None and b.token_ids == PROMPT  # a hit reads the right content
    assert_quiet_and_empty(pipe)
    return b.cached_tokens


def test_same_namespace_hits(models: Models) -> None:
    assert cached_after(models, "tenant-a", "tenant-a") == REUSABLE


@pytest.mark.parametrize(("first", "second"), [("tenant-a", "tenant-b"), ("tenant-b", "tenant-a")])
def test_other_tenant_misses_both_directions(models: Models, first: str, second: str) -> None:
    assert cached_after(models, first, second) == 0


def test_cache_salt_same_hits_different_misses(models: Models) -> None:
    assert cached_after(models, "tenant-a:salt-1", "tenant-a:salt-1") == REUSABLE
    assert cached_after(models, "tenant-a:salt-1", "tenant-a:salt-2") == 0
    assert cached_after(models, "tenant-a:salt-2", "tenant-a:salt-1") == 0


def test_lab_shared_prefix_cache_leaks_across_tenants(models: Models) -> None:
    # CVE-2025-46570: with the switch on, tenant B hits tenant A's pages.
    faults = FaultSet.of(Fault.SHARED_PREFIX_CACHE)
    assert cached_after(models, "tenant-a", "tenant-b", faults) == REUSABLE


def test_operator_opt_in_shares_across_tenants(models: Models) -> None:
    assert (
        cached_after(models, "tenant-a", "tenant-b", shared_prefix_namespace="public") == REUSABLE
    )


def test_cache_off_never_hits(models: Models) -> None:
    assert cached_after(models, "tenant-a", "tenant-a", prefix_cache=False) == 0


def test_pages_enter_the_cache_only_after_their_forward(models: Models) -> None:
    pipe = models.pipeline(chunk_size=16, max_batch_tokens=16)
    submit(pipe, [work("a", "t", PROMPT, greedy(2))])
    assert pipe.prefill.cache.num_pages == 0
    pipe.pump()  # routes the submit and computes the first 16 tokens
    assert pipe.prefill.cache.num_pages == 1
    pipe.pump()
    assert pipe.prefill.cache.num_pages == 2
    pipe.drive()
    assert pipe.prefill.cache.num_pages == 4
    stats = pipe.stats().counters
    assert stats.prefix_cache_queried_tokens == len(PROMPT) and stats.prefix_cache_hit_tokens == 0


def test_cache_is_evicted_lru_when_the_pool_needs_pages(models: Models) -> None:
    pipe = models.pipeline(prefill_pages=8)
    prompts = [[(i * 50 + j) % 480 + 10 for j in range(64)] for i in range(6)]
    for i, p in enumerate(prompts):
        (r,) = run(pipe, [work(f"r{i}", "t", p, greedy(3))])
        assert r.error is None and r.token_ids == p[:3]
    # Only the most recent prompts can still be cached in 8 pages.
    assert pipe.prefill.cache.num_pages <= 8
    (again,) = run(pipe, [work("again", "t", prompts[-1], greedy(3))])
    assert again.cached_tokens == REUSABLE
    (old,) = run(pipe, [work("old", "t", prompts[0], greedy(3))])
    assert old.cached_tokens == 0
    assert_quiet_and_empty(pipe)


def test_a_hit_requires_equal_tokens_not_just_the_hash() -> None:
    pool = KVPool(KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4), 8)
    cache = PrefixCache(pool)
    owner = cache.owner_for("ns")
    (page,) = pool.allocate(owner, 1)
    key, adopted = cache.insert("ns", None, (1, 2, 3, 4), page)
    assert adopted
    assert cache.match("ns", [1, 2, 3, 4, 5]).num_tokens == 4
    cache.release([key])
    assert cache.match("other", [1, 2, 3, 4, 5]).num_tokens == 0
    cache._entries[key].tokens = (9, 9, 9, 9)  # as if another prefix had collided on this key
    assert cache.match("ns", [1, 2, 3, 4, 5]).num_tokens == 0
    cache.release([key])
    assert cache.clear() == 1 and pool.num_free == 8
    pool.check_integrity()


def test_cached_pages_belong_to_the_namespace_in_the_ledger(models: Models) -> None:
    pipe = models.pipeline()
    run(pipe, [work("a", "tenant-a", PROMPT, greedy(2))])
    owners = {pipe.prefill_pool.label(h.owner) for h in pipe.prefill.cache.handles()}
    assert owners == {"prefix-cache:tenant-a"}
