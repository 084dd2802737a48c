"""Faults on the real PD stack: sglang-router in front, Mooncake / NIXL moving the KV.

A transfer is caught "mid-transfer" with the lab's grant hold
(`transfer/lab_holds.py`, switched by `--lab-fault hold=FOLDER`): the prefill worker
that has just been granted decode's pages (I7: they are inbound) parks before
its engine writes a byte and says so with a file naming its pid; the test
then kills or freezes exactly that process. The freeze case also holds
decode's steps, so the late write lands after another request's KV has
landed and before decode reads it: the order is fixed, never a race. The
router runs with retries off so the affected request's own outcome reaches
the client (with retries on it is re-sent to a fresh pair; that is the
router's business, not a fence).

Each case asserts the same three things: the affected request ends with an
error (never a short 200), every other request completes in full, and once
quiet every surviving worker's ledger check is ok with no page used or pending.
The `early-free` stack is the proof the freeze case can fail: the late write
lands in a reused page and another tenant's output shows it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from sgl_helpers import OPERATOR_KEY, SCALE, text_of

from kvfence.faults import Fault, FaultSet
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.stack import Stack, StackSpec, Worker

pytestmark = pytest.mark.slow
SENTINEL = "ZQXTBNVLQJ"
HALF = 150  # prompt and max_tokens: together within the per-request limit (336)
# The pair wait (30 s by default): a frozen or killed worker's room fails by then, and the
# cases wait for it; a third of the default keeps every honest pair well inside it.
PAIR_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Rig:
    stack: Stack
    keys: dict[str, str]
    tokenizer: Tokenizer
    model: str
    hold: Path  # the grant hold's folder

    @property
    def url(self) -> str:
        return self.stack.url

    def workers(self, role: str) -> list[Worker]:
        return [w for w in self.stack.workers if w.role == role]

    def pid(self, name: str) -> int:
        return self.stack.supervisor.procs[name].pid

    def name_of(self, pid: int) -> str:
        return next(n for n, p in self.stack.supervisor.procs.items() if p.pid == pid)

    def log_tails(self, lines: int = 25) -> str:
        """The last lines of every process's log, for a failure's message."""
        return "\n".join(
            f"--- {name}:\n" + "\n".join(self.stack.log(name).splitlines()[-lines:])
            for name in self.stack.supervisor.procs
        )

    def facts(self, w: Worker) -> dict[str, Any]:
        url = self.stack.router_url_of(w)
        return dict(httpx.get(f"{url}/server_info", timeout=10).json())


@contextmanager
def rig(
    checkpoint: Path,
    tmp: Path,
    transport: str,
    n_prefill: int = 2,
    n_decode: int = 1,
    faults: FaultSet | None = None,
) -> Iterator[Rig]:
    tenants = TenantRegistry.generate(("tenant-a", "tenant-b")).with_operator_keys((OPERATOR_KEY,))
    tenants_file = tmp / "tenants.json"
    tenants_file.write_text(tenants.to_json())
    hold = tmp / "hold"
    hold.mkdir()
    args = [
        "--model", str(checkpoint), "--model-kind", "mirror",
        "--context-length", str(SCALE.context_length), "--page-size", str(SCALE.page_size),
        "--kv-pages", f"prefill={SCALE.prefill_pages},decode={SCALE.decode_pages}",
        "--torch-threads", "1", "--transport", transport, "--no-prefix-cache",
        "--allow-undersized-pool", "--pair-timeout", str(PAIR_TIMEOUT_S),
    ]  # fmt: skip
    for f in replace(faults or FaultSet(), hold=hold).names():  # the hold: the lab switch
        args += ["--lab-fault", f]
    spec = StackSpec(
        tuple(args),
        tenants_file,
        n_prefill=n_prefill,
        n_decode=n_decode,
        router_args=("--disable-retries",),
    )
    with Stack(spec, workdir=tmp) as stack:
        keys = {t.name: t.keys[0] for t in tenants.tenants}
        yield Rig(stack, keys, Tokenizer.from_dir(checkpoint), checkpoint.name, hold)


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    text: str
    completion_tokens: int
    body: str

    def full(self, tokenizer: Tokenizer, prompt: str, max_tokens: int) -> bool:
        """A complete 200 of the tenant's own echo (the mirror replays its own prompt first)."""
        own = tokenizer.decode(tokenizer.encode(prompt))
        n = min(len(own), len(self.text))
        return (
            self.status == 200 and self.completion_tokens == max_tokens and self.text[:n] == own[:n]
        )


def post(r: Rig, tenant: str, prompt: str, max_tokens: int, timeout: float = 120) -> Outcome:
    body = {"model": r.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    try:
        resp = httpx.post(
            f"{r.url}/v1/completions",
            headers={"Authorization": f"Bearer {r.keys[tenant]}"},
            json={**body, "ignore_eos": True},
            timeout=timeout,
        )
    except httpx.HTTPError as e:  # the connection itself broke: an error, never a 200
        return Outcome(0, "", 0, repr(e))
    if resp.status_code != 200:
        return Outcome(resp.status_code, "", 0, resp.text)
    obj = resp.json()
    text = "".join(c.get("text", "") for c in obj.get("choices", []))
    return Outcome(200, text, int(obj["usage"]["completion_tokens"]), resp.text)


def hold_next_grant(r: Rig, send: Any) -> tuple[threading.Thread, dict[str, Outcome], int]:
    """Arm the hold, run `send()` in a thread, wait for a grant: (thread, result, held pid)."""
    result: dict[str, Outcome] = {}
    (r.hold / "hold").touch()
    t = threading.Thread(target=lambda: result.setdefault("v", send()))
    t.start()
    end = time.monotonic() + 60
    while time.monotonic() < end:
        granted = list(r.hold.glob("granted-*"))
        if granted:
            for g in granted:
                g.unlink()
            return t, result, int(granted[0].name.split("-")[1])
        time.sleep(0.01)
    raise AssertionError("no prefill worker was granted pages within 60 s")


def wait_quiet(r: Rig, w: Worker, timeout: float = 20.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    facts = r.facts(w)
    while time.monotonic() < end:
        if facts["pages_used"] == 0 and facts["pages_pending"] == 0 and facts["integrity"]:
            return facts
        time.sleep(0.2)
        facts = r.facts(w)
    return facts


def assert_quiet(r: Rig, workers: list[Worker]) -> None:
    for w in workers:
        facts = wait_quiet(r, w)
        got = (facts["pages_used"], facts["pages_pending"], facts["integrity"])
        assert got == (0, 0, "ok"), (w.name, got)


def wait_for(folder: Path, pattern: str, what: str, timeout: float = 60.0) -> Path:
    """The first file in `folder` matching `pattern`, once a worker has written it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {timeout:.0f} s ({folder / pattern})")


@dataclass(frozen=True, slots=True)
class Frozen:
    victim: Outcome
    other: Outcome  # another tenant's answer, decoded over the pages after the late write
    other_own: str
    pending: int  # decode's parked pages once A's room was given up
    late_write: str  # how A's late transfer ended: "ok" when every byte was written
    # What the rig saw, for a failure's message: how long decode took to give A's room
    # up and what it held then, and the last lines of every process's log.
    waited_s: float = 0.0
    decode_facts: str = ""
    logs: str = field(default="", repr=False)

    def explain(self) -> str:
        return (
            f"{self!r}\nwaited {self.waited_s:.1f} s; decode then: {self.decode_facts}\n{self.logs}"
        )


def freeze_mid_transfer(r: Rig) -> Frozen:
    """A's transfer is granted, then its prefill is frozen (SIGSTOP) before a byte moves.

    Decode gives A's room up by its pair deadline and releases A's pages. B (the
    same length, so it needs as many pages) goes through the other prefill to
    the same decode, which holds B landed and reconciled but unread (the lab's
    `hold-decode`). Only then is A's prefill woken (SIGCONT): its engine writes
    where the grant said, and once that write has ended B decodes. The holds fix
    the order; no timing is assumed (B's 150 tokens take 0.2 s).
    """
    a_prompt = text_of(r.tokenizer, f"{SENTINEL} invoice ", HALF)
    b_prompt = text_of(r.tokenizer, "weather report ", HALF)
    t, result, pid = hold_next_grant(r, lambda: post(r, "tenant-a", a_prompt, HALF))
    os.kill(pid, signal.SIGSTOP)
    other: dict[str, Outcome] = {}
    b = threading.Thread(target=lambda: other.setdefault("v", post(r, "tenant-b", b_prompt, HALF)))
    try:
        wait_stopped(pid)
        (r.hold / "hold").unlink()  # it stays parked until it runs again
        decode = r.workers("decode")[0]
        began = time.monotonic()
        while r.facts(decode)["pages_used"] and time.monotonic() < began + 60:
            time.sleep(0.2)  # decode gave A's room up (pair deadline): its pages are released
        waited = time.monotonic() - began
        facts = r.facts(decode)
        pending = int(facts["pages_pending"])
        for stale in r.hold.glob("decoding-*"):
            stale.unlink()
        (r.hold / "hold-decode").touch()
        b.start()
        wait_for(r.hold, "decoding-*", "decode holding B's landed KV")
        os.kill(pid, signal.SIGCONT)
        late_write = wait_for(r.hold, f"sent-{pid}-*", "end of A's late write").read_text()
    finally:
        (r.hold / "hold-decode").unlink(missing_ok=True)
        os.kill(pid, signal.SIGCONT)
    b.join(120)
    t.join(120)
    own = r.tokenizer.decode(r.tokenizer.encode(b_prompt))
    shown = {k: facts.get(k) for k in ("pages_used", "pages_pending", "integrity")}
    return Frozen(
        result["v"], other["v"], own, pending, late_write, waited, str(shown), r.log_tails()
    )


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until the process is stopped (its state in /proc is T): a signal is delivered when
    the process next runs, which on a busy host is not at once."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] in "Tt":
            return
        time.sleep(0.01)
    raise AssertionError(f"prefill {pid} did not stop within {timeout:.0f} s of SIGSTOP")


# ---- the shared stacks: two prefill workers, one decode, per transport ----------------------


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def two_prefill(
    request: pytest.FixtureRequest, sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rig]:
    transport = str(request.param)
    pytest.importorskip("mooncake.engine" if transport == "mooncake" else "nixl_cu12")
    with rig(sgl_checkpoint, tmp_path_factory.mktemp(f"faults-{transport}"), transport) as r:
        yield r


def test_prefill_rejects_while_decode_has_reserved(two_prefill: Rig) -> None:
    """Both workers get B's over-pool prompt at once: decode reserves, prefill refuses (I2).

    The refusal reaches decode over the bootstrap channel with the original error; decode
    answers it and releases the reservation; A's requests alongside complete in full."""
    r = two_prefill
    over = text_of(r.tokenizer, "weather report ", 424)  # > prefill pool 336, < context 512
    prompts = [("tenant-b", over, 16)] + [("tenant-a", f"alongside {i} " * 6, 24) for i in range(4)]
    with ThreadPoolExecutor(5) as pool:
        outs = list(pool.map(lambda p: post(r, *p), prompts))
    assert outs[0].status == 400 and "336" in outs[0].body, outs[0]
    for (_, prompt, n), out in zip(prompts[1:], outs[1:], strict=True):
        assert out.full(r.tokenizer, prompt, n), out
    assert_quiet(r, r.stack.workers)


def test_frozen_prefill_writes_late_into_parked_pages_only(two_prefill: Rig) -> None:
    """Freeze prefill mid-transfer: A fails with decode's error, B is untouched (I7)."""
    r = two_prefill
    frozen = freeze_mid_transfer(r)
    # Decode's 504 (pair deadline); the router re-labels a decode error 500, message kept.
    said = f"said nothing of it for {PAIR_TIMEOUT_S:g} s"  # the wait `--pair-timeout` set
    assert frozen.victim.status >= 500 and said in frozen.victim.body, frozen.explain()
    assert frozen.pending > 0  # A's pages parked until its late write is confirmed (I7)
    assert frozen.late_write == "ok"  # it landed before B read a token: the case is not vacuous
    assert frozen.other.full(r.tokenizer, frozen.other_own, HALF), frozen.other
    assert SENTINEL not in frozen.other.text, frozen.other.text[:300]
    assert frozen.other.text.startswith(frozen.other_own), frozen.other.text[:300]
    assert_quiet(r, r.stack.workers)
    ok = post(r, "tenant-a", "after the thaw " * 4, 12)
    assert ok.full(r.tokenizer, "after the thaw " * 4, 12), ok


def test_prefill_killed_mid_transfer_fails_its_request_only(two_prefill: Rig) -> None:
    """Last on the shared stack (it kills a worker). The dead sender is decode's confirmation
    that nothing more will land (I7): A fails at once, A's pages come back, others finish."""
    r = two_prefill
    a_prompt = "killed mid transfer " * 6
    t, result, pid = hold_next_grant(r, lambda: post(r, "tenant-a", a_prompt, 24))
    survivor = next(w for w in r.workers("prefill") if r.pid(w.name) != pid)
    # Killed while still parked: the hold is lifted only once the held worker is gone, or it
    # could finish the transfer in the moment between the two (CI saw a full 200 that way).
    os.kill(pid, signal.SIGKILL)
    r.stack.supervisor.procs[r.name_of(pid)].wait(30)
    (r.hold / "hold").unlink()  # the survivor must not park the requests below
    others = [f"meanwhile {i} " * 6 for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        t.join(60)
        # The router still round-robins onto the dead worker: those requests fail, loudly.
        outs = list(pool.map(lambda p: post(r, "tenant-b", p, 24), others))
    victim = result["v"]
    assert victim.status >= 400 or victim.status == 0, victim
    assert victim.status != 200
    full = [o for p, o in zip(others, outs, strict=True) if o.full(r.tokenizer, p, 24)]
    assert full, outs  # requests through the surviving prefill complete
    assert all(o.status != 200 or o in full for o in outs), outs  # never a short 200
    assert_quiet(r, [survivor, *r.workers("decode")])


# ---- the proof: the same freeze with `early-free` on ---------------------------------------


def test_early_free_lets_the_late_mooncake_write_into_another_tenants_pages(
    sgl_checkpoint: Path, tmp_path: Path
) -> None:
    pytest.importorskip("mooncake.engine")
    with rig(sgl_checkpoint, tmp_path, "mooncake", faults=FaultSet.of(Fault.EARLY_FREE)) as r:
        frozen = freeze_mid_transfer(r)
    assert frozen.victim.status >= 500 and "said nothing of it" in frozen.victim.body, (
        frozen.explain()
    )
    assert frozen.pending == 0  # A's pages went straight back to the free list
    assert frozen.late_write == "ok", frozen.explain()
    # A 200 with B's token count, built from A's prompt: the incident's answer.
    assert frozen.other.status == 200 and frozen.other.completion_tokens == HALF, frozen.other
    assert SENTINEL in frozen.other.text, frozen.other.text[:300]


# ---- decode killed mid-generation: one prefill, two decode workers -------------------------


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_decode_killed_mid_generation_fails_its_requests_only(
    sgl_checkpoint: Path, tmp_path: Path, transport: str
) -> None:
    pytest.importorskip("mooncake.engine" if transport == "mooncake" else "nixl_cu12")
    with rig(sgl_checkpoint, tmp_path, transport, n_prefill=1, n_decode=2) as r:
        victim = r.workers("decode")[0]
        prompts = [f"long request {i} " for i in range(4)]
        n = 300
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, r, "tenant-a", p, n) for p in prompts]
            end = time.monotonic() + 60
            while time.monotonic() < end and not r.facts(victim)["pages_used"]:
                time.sleep(0.01)
            time.sleep(0.1)  # its KV has landed: it is generating
            os.kill(r.pid(victim.name), signal.SIGKILL)
            outs = [f.result(timeout=120) for f in futures]
        full = [o for p, o in zip(prompts, outs, strict=True) if o.full(r.tokenizer, p, n)]
        assert full and len(full) < len(outs), outs  # some on each decode
        assert all(o.status != 200 or o in full for o in outs), outs  # never a short 200
        assert_quiet(r, [*r.workers("prefill"), r.workers("decode")[1]])
