"""Prefix cache namespaced by tenant (invariant I8).

Full pages are keyed by a chained hash: key_i = hash(key_{i-1}, namespace,
tokens of page i). A hit needs the same namespace AND the same token ids
(checked on every hit; the hash only finds the candidate) AND the same parent
entry, so a page is only ever reused after the exact same prefix, by the
same namespace.

A namespace is the tenant (plus `cache_salt` when the request gives one),
chosen by the router. Cached pages belong in the pool ledger to a
per-namespace owner id, so the ledger itself refuses a read of tenant A's
cached page by tenant B (I1 backs I8). Cross-tenant sharing exists only when
the operator configures an explicit shared namespace, or under the lab switch
`shared-prefix-cache` (CVE-2025-46570), which collapses every namespace into
one.

Lifecycle of a page: a request allocates its full prompt pages under its
namespace owner, computes them, and only then offers them to the cache
(`insert`); pages enter the cache only after their forward pass wrote them.
Every user of an entry holds a reference; entries with no reference are
evicted least-recently-used when the pool needs pages, and eviction releases
the page through the pool (owner cleared, generation bumped: I5).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import KVPool, PageHandle

LAB_SHARED_NAMESPACE = "*shared-by-lab-fault*"


@dataclass(slots=True)
class _Entry:
    key: int
    parent: int | None
    namespace: str
    tokens: tuple[int, ...]
    handle: PageHandle
    refs: int


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Pages a request may read from the cache; it holds one reference on each key."""

    handles: tuple[PageHandle, ...]
    keys: tuple[int, ...]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.handles) * self.page_size


def chain_key(parent: int | None, namespace: str, tokens: tuple[int, ...]) -> int:
    return hash((parent, namespace, tokens))


class PrefixCache:
    def __init__(
        self,
        pool: KVPool,
        *,
        faults: FaultSet | None = None,
        shared_namespace: str | None = None,
        enabled: bool = True,
    ) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.faults = faults or FaultSet()
        self.shared_namespace = shared_namespace
        self.enabled = enabled
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU order, oldest first
        self._owners: dict[str, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        # Entries no request references (refs == 0), kept with every change of a count so a
        # status or a scrape reads it without walking the cache.
        self._unreferenced = 0

    # ---- namespaces -------------------------------------------------------------------

    def resolve(self, namespace: str) -> str:
        """The namespace a request actually uses (I8: its own unless sharing is configured)."""
        if Fault.SHARED_PREFIX_CACHE in self.faults:
            return LAB_SHARED_NAMESPACE
        if self.shared_namespace is not None:
            return self.shared_namespace
        return namespace

    def owner_for(self, namespace: str) -> int:
        """The pool owner id of a (resolved) namespace, registered on first use."""
        owner = self._owners.get(namespace)
        if owner is None:
            owner = self.pool.register_owner(f"prefix-cache:{namespace}")
            self._owners[namespace] = owner
        return owner

    # ---- lookups ----------------------------------------------------------------------

    def match(self, namespace: str, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached run of full pages, never the whole prompt (one token must be computed)."""
        ps = self.page_size
        limit = (len(tokens) - 1) // ps
        if not self.enabled:
            return PrefixHit((), (), ps)
        entries: list[_Entry] = []
        parent: int | None = None
        for i in range(limit):
            page = tuple(tokens[i * ps : (i + 1) * ps])
            entry = self._entries.get(chain_key(parent, namespace, page))
            if entry is None or not (
                entry.namespace == namespace and entry.tokens == page and entry.parent == parent
            ):
                break
            entries.append(entry)
            parent = entry.key
        for entry in reversed(entries):  # leaf first, root last: evict leaves before roots
            self._unreferenced -= entry.refs == 0
            entry.refs += 1
            self._entries.move_to_end(entry.key)
        return PrefixHit(tuple(e.handle for e in entries), tuple(e.key for e in entries), ps)

    def record(self, queried_tokens: int, hit: PrefixHit) -> None:
        """Count a lookup that a request went on to use (for usage and metrics)."""
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit.num_tokens

    def insert(
        self, namespace: str, parent: int | None, tokens: tuple[int, ...], handle: PageHandle
    ) -> tuple[int, bool]:
        """Offer one computed full page. Returns (its key, whether the cache adopted the page).

        Adopted: the caller now holds a reference instead of the page. Not
        adopted (cache off, or the same prefix was cached meanwhile): the page
        stays the caller's to release.
        """
        if len(tokens) != self.page_size:
            raise ValueError(f"only full pages are cached, got {len(tokens)} tokens")
        key = chain_key(parent, namespace, tokens)
        if not self.enabled or key in self._entries:
            return key, False
        self._entries[key] = _Entry(key, parent, namespace, tokens, handle, refs=1)
        return key, True

    def release(self, keys: Sequence[int]) -> None:
        """Drop one reference per key (the page stays cached until evicted)."""
        for key in keys:
            entry = self._entries[key]
            if entry.refs <= 0:
                raise AssertionError(f"prefix-cache entry {key} released more often than taken")
            entry.refs -= 1
            self._unreferenced += entry.refs == 0

    def evict(self, n_pages: int) -> int:
        """Release up to `n_pages` unreferenced pages, least recently used first."""
        victims = [e for e in self._entries.values() if e.refs == 0][:n_pages]
        for entry in victims:
            del self._entries[entry.key]
        self._unreferenced -= len(victims)
        self.pool.release([e.handle for e in victims])
        return len(victims)

    def clear(self) -> int:
        return self.evict(len(self._entries))

    # ---- introspection ----------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return self._unreferenced

    def handles(self) -> list[PageHandle]:
        return [e.handle for e in self._entries.values()]
