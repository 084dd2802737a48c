"""The prefix cache's evictable-page count, kept as refs change, always equals a walk of it.

Prefill admission adds it to the free pages, and the KV usage gauge counts those pages
free: a count that drifted would admit a prompt the pool cannot hold or show a full pool
as idle. Random sequences of lookups, inserts, releases and evictions on a real pool.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.engine.prefix_cache import PrefixCache
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool

PAGE = 4
PAGES = 24
PROMPTS = [tuple(range(k, k + 3 * PAGE + 1)) for k in (0, 100)]  # 3 full pages + 1 token each
OPS = st.lists(
    st.tuples(st.sampled_from(["request", "release", "evict"]), st.integers(0, 5)), max_size=40
)


def _walk(cache: PrefixCache) -> int:
    return sum(1 for e in cache._entries.values() if e.refs == 0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(OPS)
def test_evictable_count_matches_a_walk(ops: list[tuple[str, int]]) -> None:
    pool = KVPool(KVGeometry(1, 1, 2, page_size=PAGE), PAGES)
    cache = PrefixCache(pool)
    held: list[list[int]] = []  # each request's references (its hit and what it inserted)
    for op, n in ops:
        if op == "request":  # as prefill does: take the hit, compute and offer the rest
            namespace = "ab"[n % 2]
            tokens = PROMPTS[n % 2]
            hit = cache.match(namespace, tokens)
            keys, parent = list(hit.keys), (hit.keys[-1] if hit.keys else None)
            for i in range(len(hit.keys), len(tokens) // PAGE):
                if not pool.can_allocate(1):
                    cache.evict(1)
                if not pool.can_allocate(1):
                    break
                [page] = pool.allocate(cache.owner_for(namespace), 1)
                key, adopted = cache.insert(
                    namespace, parent, tokens[i * PAGE : (i + 1) * PAGE], page
                )
                if adopted:
                    keys.append(key)
                else:
                    pool.release([page])
                parent = key
            held.append(keys)
        elif op == "release" and held:
            cache.release(held.pop(n % len(held)))
        elif op == "evict":
            before = cache.num_evictable
            assert cache.evict(n) == min(n, before)
        assert cache.num_evictable == _walk(cache)
    for keys in held:
        cache.release(keys)
    cached = cache.num_pages
    assert cache.num_evictable == _walk(cache) == cached  # nothing referenced: all evictable
    assert cache.clear() == cached
    assert cache.num_evictable == 0 and pool.num_used == 0
