"""Lab only: holds that put a KV transfer at an exact point against decode's reads.

The faults tests (tests/sglang/test_sglang_faults.py) need a late write to land
at a known moment: after decode has given the room up, and before another
request decodes over the pages. Timing alone cannot promise that (a tiny
model decodes 150 tokens in 0.2 s), so both workers share one folder, named
by the lab's switch `--lab-fault hold=FOLDER` (the fault registry, listed in
/server_info like every switch), and talk to the test through files in it:

- prefill: while `hold` exists, a sender that has its grant (I7: decode's
  pages are inbound) writes `granted-<pid>-<room>` and waits before the
  engine writes a byte; once that held transfer ends it writes
  `sent-<pid>-<room>` holding "ok" or why it failed.
- decode: while `hold-decode` exists, decode runs no step while it has rows
  to decode and writes `decoding-<pid>` once: what landed is reconciled, and
  nothing has read it yet.

They only delay: every fence stays where it is. Without the switch no hold
exists and the senders and decode's loop pay one `is None` test.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvfence.faults import FaultSet

POLL_S = 0.01


@dataclass(frozen=True, slots=True)
class LabHold:
    """Both workers' holds, in the one folder the lab's `hold=FOLDER` switch names."""

    folder: Path

    @classmethod
    def of(cls, faults: FaultSet) -> LabHold | None:
        """The hold the lab switched on; None (production) unless `faults` names a folder."""
        return cls(faults.hold) if faults.hold is not None else None

    # ---- prefill: park a granted in-place transfer before its first byte ---------------------

    def wait(self, room: str) -> bool:
        """Whether the transfer was held (then `sent` reports how it ended)."""
        flag = self.folder / "hold"
        if not flag.exists():
            return False
        (self.folder / f"granted-{os.getpid()}-{room}").touch()
        while flag.exists():
            time.sleep(POLL_S)
        return True

    def sent(self, room: str, outcome: str) -> None:
        """The transfer ended: "ok" (every byte written, the end sent) or why not.

        Written under a name the test does not look for, then renamed (atomic): a reader that
        finds `sent-*` reads the whole outcome, never the empty file `write_text` opens first.
        """
        final = self.folder / f"sent-{os.getpid()}-{room}"
        partial = self.folder / f".{final.name}.partial"
        partial.write_text(outcome)
        partial.replace(final)

    # ---- decode: no step over rows ready to decode while `hold-decode` exists ----------------

    def holds_step(self, decoding: bool) -> bool:
        """Whether to skip this step; sleeps one poll when it does, so the loop does not spin."""
        if not decoding or not (self.folder / "hold-decode").exists():
            return False
        marker = self.folder / f"decoding-{os.getpid()}"
        if not marker.exists():
            marker.touch()
        time.sleep(POLL_S)
        return True
