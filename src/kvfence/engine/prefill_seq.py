"""One prompt in prefill: its state and its pages.

A prompt gets every page beyond its prefix-cache hit or none (never a partial
allocation, so a waiting prompt holds nothing), and offers the full pages its
forward computed to its namespace's prefix cache (I8: only once written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.engine.messages import PrefillWork
from kvfence.engine.prefix_cache import PrefixCache, PrefixHit
from kvfence.engine.request import Request
from kvfence.kv.pool import KVPool, PageHandle


@dataclass(slots=True, eq=False)
class PrefillSeq:
    req: Request
    work: PrefillWork
    owner: int  # this request's own pool owner id
    namespace: str  # resolved prefix-cache namespace (I8)
    ns_owner: int  # pool owner id of that namespace
    input_ids: tuple[int, ...]  # what is computed: the prompt (or the lab's placeholder)
    arrival: int = 0  # submission order, for admission (`prefill_order`)
    overtaken: int = 0  # later arrivals admitted while this one waited
    pages: list[PageHandle] = field(default_factory=list)  # covers input_ids, in order
    own_pages: list[PageHandle] = field(default_factory=list)  # released by this request
    cache_keys: list[int] = field(default_factory=list)  # cache references held
    parent_key: int | None = None  # chain key of the last full page computed
    computed: int = 0
    cached_tokens: int = 0
    started_s: float | None = None  # perf_counter at its first forward step (prefill time)

    @property
    def remaining(self) -> int:
        return len(self.input_ids) - self.computed

    def take_pages(self, pool: KVPool, cache: PrefixCache) -> bool:
        """All pages the prompt needs beyond its cache hit, or none (and False)."""
        ps = pool.page_size
        n_tokens = len(self.input_ids)
        hit = cache.match(self.namespace, self.input_ids)
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
        full_owner = self.ns_owner if cache.enabled else self.owner
        full = pool.allocate(full_owner, n_full - len(hit.handles))
        tail = pool.allocate(self.owner, n_total - n_full)
        self._use_hit(cache, hit, n_tokens)
        self.pages.extend(full + tail)
        self.own_pages = full + tail
        return True

    def _use_hit(self, cache: PrefixCache, hit: PrefixHit, n_tokens: int) -> None:
        cache.record(n_tokens, hit)
        self.pages = list(hit.handles)
        self.cache_keys = list(hit.keys)
        self.parent_key = hit.keys[-1] if hit.keys else None
        self.computed = self.cached_tokens = hit.num_tokens

    def offer_full_pages(self, cache: PrefixCache, page_size: int, start: int) -> None:
        """Offer the pages completed since token `start` to the cache: only now has the
        forward written them (I8). An adopted page is the cache's to release, not ours."""
        ps = page_size
        for i in range(start // ps, self.computed // ps):
            page = self.pages[i]
            key, adopted = cache.insert(
                self.namespace, self.parent_key, self.input_ids[i * ps : (i + 1) * ps], page
            )
            self.parent_key = key
            if adopted:
                self.cache_keys.append(key)
                self.own_pages.remove(page)
