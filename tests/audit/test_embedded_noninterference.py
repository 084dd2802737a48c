"""The main job's noninterference check on its two embedded targets, with the default load.

The lab's leak reads back the page released last (LIFO reuse): it shows under A's
load only where A's traffic rewrote that page between two B repeats. A's default
requests are short (the check's wall time) yet grow a page mid-decode, so the long
probe must diverge on all but at most one repeat under load on the lab (a FAIL), and
never on the hardened engine (`NoninterferenceConfig`'s docstring: A requests that
never grow a page missed the leak in 7 of 17 runs). It fails with the turnover wait
switched off (`Load.wait_for_turnover` always true: 7 of 40 under load, a PASS).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfence.audit.base import Verdict
from kvfence.audit.embedded import audit_embedded

pytestmark = pytest.mark.slow


def test_lab_fails_and_hardened_passes_noninterference_with_the_default_load() -> None:
    run = audit_embedded(checks=("noninterference",))
    lab, hardened = run.results
    assert lab.verdict is Verdict.FAIL, lab.summary
    ev: Any = lab.evidence
    loaded = ev["under_load"]["per_probe"][str(len(ev["probe_tokens"]) - 1)]  # the long probe
    # The phase stops once the FAIL is certain (`curtail`): by then the long probe has
    # diverged on every repeat under load but at most one.
    assert loaded["diverged"] >= loaded["answers"] - 1 >= 3, loaded
    assert ev["baseline"]["diverged"] == 0
    assert hardened.verdict is Verdict.PASS, hardened.summary
    for res in (lab, hardened):
        load: Any = res.evidence["load"]
        assert load["repeats_without_turnover"] == 0
