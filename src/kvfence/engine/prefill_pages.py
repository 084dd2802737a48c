"""Prefill's pages: a prompt gets every page beyond its cache hit or none, and offers the
full pages it computed to its namespace's prefix cache (I8)."""

from __future__ import annotations

from kvfence.engine.prefill_seq import PrefillSeq
from kvfence.engine.prefix_cache import PrefixCache, PrefixHit
from kvfence.kv.pool import KVPool


def allocate(pool: KVPool, cache: PrefixCache, seq: PrefillSeq) -> bool:
    """All pages the prompt needs beyond its cache hit, or none (and False)."""
    ps = pool.page_size
    n_tokens = len(seq.input_ids)
    hit = cache.match(seq.namespace, seq.input_ids)
    n_total = -(-n_tokens // ps)
    n_full = n_tokens // ps
    n_need = n_total - len(hit.handles)
    short = n_need - pool.num_free
    if short > 0:
        cache.evict(short)
    if not pool.can_allocate(n_need):
        cache.release(hit.keys)
        return False
    # Full pages may later enter the namespace's cache, so the namespace owns them.
    full_owner = seq.ns_owner if cache.enabled else seq.owner
    full = pool.allocate(full_owner, n_full - len(hit.handles))
    tail = pool.allocate(seq.owner, n_total - n_full)
    _use_hit(cache, seq, hit, n_tokens)
    seq.pages.extend(full + tail)
    seq.own_pages = full + tail
    return True


def _use_hit(cache: PrefixCache, seq: PrefillSeq, hit: PrefixHit, n_tokens: int) -> None:
    cache.record(n_tokens, hit)
    seq.pages = list(hit.handles)
    seq.cache_keys = list(hit.keys)
    seq.parent_key = hit.keys[-1] if hit.keys else None
    seq.computed = seq.cached_tokens = hit.num_tokens


def cache_full_pages(
    cache: PrefixCache, page_size: int, seq: PrefillSeq, start: int, end: int
) -> None:
    """Offer pages this step completed to the cache: only now has the forward written them (I8)."""
    ps = page_size
    for i in range(start // ps, end // ps):
        page = seq.pages[i]
        key, adopted = cache.insert(
            seq.namespace, seq.parent_key, seq.input_ids[i * ps : (i + 1) * ps], page
        )
        seq.parent_key = key
        if adopted:
            seq.cache_keys.append(key)
            seq.own_pages.remove(page)
