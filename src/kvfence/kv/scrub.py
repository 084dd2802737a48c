"""The scrub policy, torch-free so the command line can offer its choices without the pool."""

from __future__ import annotations

import enum


class ScrubPolicy(enum.Enum):
    """When page contents are zeroed. Invalidation (I5) happens regardless."""

    NONE = "none"  # like SGLang and vLLM: stale bytes stay, the ledger guards reads
    ON_RELEASE = "on_release"
    ON_ALLOCATE = "on_allocate"
