"""The lab's hold is a fault-registry switch (`--lab-fault hold=FOLDER`), and only that.

Production builds no hold (`FaultSet()` has none); the switch round-trips through the
names every launcher passes to its workers, a bad folder is refused at the command line
with what is wrong, and a hold built from the switch really parks a granted transfer
before its first byte (in-process transport, real pools) until the test lifts it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.engine.messages import PageRef, TransferDone
from kvfence.engine.outbound import OutboundTransfer
from kvfence.engine.reconcile import Reservation
from kvfence.faults import Fault, FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool
from kvfence.transfer.lab_holds import LabHold
from kvfence.transfer.registry import get_transport
from kvfence.transfer.rooms import Landed
from kvfence.transfer.senders import Senders

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
TOKENS = 10  # three pages of 4, the last one partly filled
WAIT_S = 30.0  # a hang guard for one thread on a loaded host, not a timing assertion


def test_the_hold_round_trips_through_the_names_a_launcher_passes(tmp_path: Path) -> None:
    faults = FaultSet.parse(["early-free", f"hold={tmp_path}"])
    assert faults.hold == tmp_path and Fault.EARLY_FREE in faults
    assert faults.names() == ["early-free", f"hold={tmp_path}"]  # what /server_info lists
    assert FaultSet.parse(faults.names()) == faults
    assert FaultSet.parse([f"hold={tmp_path}"])  # a held worker is a lab worker
    assert LabHold.of(faults) == LabHold(tmp_path)


def test_production_builds_no_hold() -> None:
    assert LabHold.of(FaultSet()) is None
    assert not FaultSet() and FaultSet().names() == []


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("hold", "hold=FOLDER (an existing directory)"),
        ("hold=", "hold=FOLDER (an existing directory)"),
        ("hold=/nonexistent/kvfence-hold", "no such directory"),
    ],
)
def test_a_bad_hold_is_refused_at_the_command_line(given: str, says: str) -> None:
    result = CliRunner().invoke(main, ["serve", "--lab-fault", given])
    assert result.exit_code == 2, result.output
    assert "--lab-fault" in result.output and says in result.output


def test_one_hold_folder_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="given twice"):
        FaultSet.parse([f"hold={tmp_path}", f"hold={tmp_path}"])


def _wait_for(what: str, found: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not found():
        assert time.monotonic() < deadline, f"waited {WAIT_S:.0f} s for {what}"
        time.sleep(0.005)


def test_the_switch_parks_a_granted_transfer_before_its_first_byte(tmp_path: Path) -> None:
    transport = get_transport("inprocess")
    decode_pool = transport.create_pool(GEOM, 8, faults=FaultSet())
    receiver = transport.receiver(decode_pool)
    owner = decode_pool.register_owner("room-1")
    dest = decode_pool.allocate(owner, GEOM.pages_for(TOKENS))
    receiver.expect(Reservation("room-1", "acme", TOKENS, tuple(dest)))
    src = KVPool(GEOM, 8)
    src.k.copy_(torch.randn(src.k.shape, generator=torch.Generator().manual_seed(1)))
    src_pages = src.allocate(src.register_owner("prefill"), GEOM.pages_for(TOKENS))
    refs = tuple(PageRef(h.index, h.generation) for h in dest)
    transfer = OutboundTransfer("room-1", "acme", TOKENS, refs, tuple(src_pages), 7, (), 0)

    senders = Senders(transport, LabHold.of(FaultSet.parse([f"hold={tmp_path}"])))
    (tmp_path / "hold").touch()
    outcome: list[str | None] = []
    sender = threading.Thread(
        target=lambda: outcome.append(senders.send(receiver.address, transfer, src)), daemon=True
    )
    sender.start()
    _wait_for("the held sender's granted-* file", lambda: any(tmp_path.glob("granted-*-room-1")))
    assert not any(isinstance(e, Landed) for e in receiver.poll())  # granted, nothing written
    assert sender.is_alive()
    (tmp_path / "hold").unlink()
    sender.join(WAIT_S)
    assert not sender.is_alive(), f"the sender did not end within {WAIT_S:.0f} s of the lift"
    assert outcome == [None]
    assert [p.read_text() for p in tmp_path.glob("sent-*-room-1")] == ["ok"]
    events = receiver.poll()
    assert any(isinstance(e, Landed) for e in events)
    assert any(isinstance(e, TransferDone) and e.ok for e in events)
