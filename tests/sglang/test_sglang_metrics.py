"""An sglang prefill worker's KV usage counts the pages only its prefix cache keeps as free,
as a single process and the hub count them (and as vLLM does): after a request, with its
prompt cached, the prefill pool's usage fraction is back to 0 while `pages_cached` > 0."""

from __future__ import annotations

from pathlib import Path

import httpx
from sgl_helpers import OPERATOR_KEY, complete, fleet, text_of, wait_quiet

from kvfence.audit.targets.base import parse_prometheus


def test_prefix_cached_pages_count_as_free_in_the_prefill_usage(
    sgl_checkpoint: Path, tmp_path: Path
) -> None:
    with fleet(sgl_checkpoint, tmp_path, prefix_cache=True) as f:
        done = complete(f, "tenant-a", text_of(f.tokenizer, "apple ", 200), 4)
        assert done.status == 200, done.text
        wait_quiet(f, "decode")
        pool = f.facts("prefill")
        assert pool["pages_used"] > 0, pool  # the prompt's pages stay, for the cache alone
        url = f.stack.router_url_of(f.worker("prefill"))
        text = httpx.get(
            f"{url}/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=30
        ).text
        usage = [
            s.value
            for s in parse_prometheus(text)
            if s.name == "kvfence_kv_cache_usage_perc" and s.labels.get("role") == "prefill"
        ]
        assert usage == [0.0], (usage, pool)
