"""The DRA driver's core: NodePrepare/NodeUnprepare for one claim, its record in SQLite, its CDI spec, and the
holds between claims and the device plugin. The claim source is a dict (pure logic); store and CDI files are real."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from lightkube.resources.resource_v1beta1 import ResourceClaim

from deviceplugin.config import Resource
from deviceplugin.discovery import Device, DeviceNode
from deviceplugin.dra import claimcdi
from deviceplugin.dra.claims import ClaimError
from deviceplugin.dra.prepare import ClaimRef, Offered, PrepareError, Preparer
from deviceplugin.dra.store import ClaimStore
from nodeplug.commands import arun
from nodeplug.log import get_logger

from support.wait import eventually

DRIVER = "devices.nodeplug.io"
POOL = "node-1"
UID1 = "11111111-2222-4333-8444-555555555555"
UID2 = "21111111-2222-4333-8444-555555555555"


def dev(i: str) -> Device:
    return Device(i, (DeviceNode(f"/dev/{i}", f"/dev/{i}"),))


FUSE = Resource(name="fuse", devices=["/dev/fuse"], offer="both", env={"A": "1"})
SER = Resource(name="ser", devices=["/dev/ttyX*"], offer="dra", reset={"command": ["true"]})


class FakeSource:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Any] = {}
        self.reads = 0

    def add(self, ns: str, name: str, uid: str, devices: list[str], admin: bool = False, pool: str = POOL) -> None:
        results = [
            {"request": "r", "driver": DRIVER, "pool": pool, "device": d, **({"adminAccess": True} if admin else {})}
            for d in devices
        ]
        self.claims[(ns, name)] = ResourceClaim.from_dict({
            "metadata": {"namespace": ns, "name": name, "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results}}},
        })  # fmt: skip

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        self.reads += 1
        if (namespace, name) not in self.claims:
            raise ClaimError(f"ResourceClaim {namespace}/{name} not found")
        return self.claims[(namespace, name)]


class FakeDevices:
    def __init__(self) -> None:
        self.offers = {
            "fuse-fuse": Offered("fuse-fuse", FUSE, dev("fuse")),
            "ser-ttyx0": Offered("ser-ttyx0", SER, dev("ttyX0")),
            "ser-ttyx1": Offered("ser-ttyx1", SER, dev("ttyX1"), problem="health command failed"),
        }
        self.dp_held: set[tuple[str, str]] = set()
        self.changes = 0
        self.resets: list[str] = []
        self.reset_fails = False
        self.permits: asyncio.Semaphore | None = None  # when set, each reset waits for a permit
        self.resetting = self.most_resetting = 0
        self.reset_started = asyncio.Event()

    def offered(self, name: str) -> Offered | None:
        return self.offers.get(name)

    def in_use_elsewhere(self, resource: str, device_id: str) -> str:
        return "in use through the device plugin" if (resource, device_id) in self.dp_held else ""

    def claims_changed(self) -> None:
        self.changes += 1

    async def reset(self, resource: Resource, devices: Sequence[Device]) -> None:
        self.resets += [d.id for d in devices]
        if self.permits is not None:
            self.resetting += 1
            self.most_resetting = max(self.most_resetting, self.resetting)
            self.reset_started.set()
            await self.permits.acquire()
            self.resetting -= 1
        await arun([sys.executable, "-c", "import sys; sys.exit(3 if sys.argv[1] == '1' else 0)",
                    "1" if self.reset_fails else "0"], timeout=10)  # fmt: skip


@pytest.fixture
def env(tmp_path: Path) -> Any:
    class Env:
        source = FakeSource()
        devices = FakeDevices()
        cdi = tmp_path / "cdi"
        db = tmp_path / "state" / "claims.db"

        def preparer(self) -> Preparer:
            return Preparer(
                driver=DRIVER, pool=POOL, store=ClaimStore(self.db), source=self.source, devices=self.devices,
                cdi_dir=self.cdi, log=get_logger("test"),
            )  # fmt: skip

    return Env()


async def test_prepare_writes_one_spec_and_is_idempotent(env: Any) -> None:
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["fuse-fuse", "ser-ttyx0"])
    got = await p.prepare(ClaimRef("ns", "c1", UID1))
    assert [d.cdi_ids for d in got] == [
        (f"k8s.{DRIVER}/claim={UID1}-fuse-fuse",),
        (f"k8s.{DRIVER}/claim={UID1}-ser-ttyx0",),
    ]
    spec = json.loads((env.cdi / f"k8s.{DRIVER}-claim_{UID1}.json").read_text())
    assert spec["kind"] == f"k8s.{DRIVER}/claim"
    fuse = spec["devices"][0]
    assert fuse["name"] == f"{UID1}-fuse-fuse"
    assert fuse["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/fuse", "hostPath": "/dev/fuse", "permissions": "rw"}
    ]
    assert "A=1" in fuse["containerEdits"]["env"] and "NODEPLUG_FUSE_DEVICES=fuse" in fuse["containerEdits"]["env"]
    assert env.devices.resets == ["ttyX0"]  # the reset command of ser, not of fuse
    assert p.held() == {
        "fuse": {"fuse": "prepared for DRA claim ns/c1"},
        "ser": {"ttyX0": "prepared for DRA claim ns/c1"},
    }
    reads = env.source.reads
    again = await p.prepare(ClaimRef("ns", "c1", UID1))
    assert again == got and env.source.reads == reads  # answered from the record, no API read


async def test_restart_then_unprepare_cleans_up(env: Any) -> None:
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["fuse-fuse"])
    await p.prepare(ClaimRef("ns", "c1", UID1))
    p.store.close()
    p2 = env.preparer()  # a new agent on the same database
    assert p2.held() == {"fuse": {"fuse": "prepared for DRA claim ns/c1"}}
    await p2.unprepare(ClaimRef("ns", "c1", UID1))
    assert list(env.cdi.iterdir()) == []
    assert p2.held() == {} and p2.store.all() == []
    await p2.unprepare(ClaimRef("ns", "c1", UID1))  # again: nothing to do, no error


async def test_unprepare_naming_another_claim_with_the_uid_removes_nothing(env: Any) -> None:
    """NodeUnprepareResources checks namespace and name as prepare does: a request with a prepared claim's UID but
    another claim's name leaves its CDI spec, its record and its devices' hold alone."""
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["fuse-fuse"])
    await p.prepare(ClaimRef("ns", "c1", UID1))
    for other in (ClaimRef("ns", "other", UID1), ClaimRef("elsewhere", "c1", UID1)):
        with pytest.raises(PrepareError, match="was prepared as ns/c1"):
            await p.unprepare(other)
    assert [r.uid for r in p.store.all()] == [UID1] and list(env.cdi.iterdir())
    assert p.held() == {"fuse": {"fuse": "prepared for DRA claim ns/c1"}}


async def test_a_preparation_killed_half_way_is_finished_by_either_side(env: Any) -> None:
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["fuse-fuse"])
    await p.prepare(ClaimRef("ns", "c1", UID1))
    # as if killed after the record and the spec, before "prepared"
    with sqlite3.connect(env.db) as c:
        c.execute("UPDATE claims SET state = 'preparing'")
    p.store.close()
    p2 = env.preparer()
    got = await p2.prepare(ClaimRef("ns", "c1", UID1))  # done again from the claim
    assert got[0].device == "fuse-fuse" and p2.store.get(UID1).state == "prepared"
    with sqlite3.connect(env.db) as c:
        c.execute("UPDATE claims SET state = 'preparing'")
    await p2.unprepare(ClaimRef("ns", "c1", UID1))
    assert list(env.cdi.iterdir()) == [] and p2.store.all() == []


async def test_one_device_one_claim(env: Any) -> None:
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["fuse-fuse"])
    env.source.add("ns", "c2", UID2, ["fuse-fuse"])
    await p.prepare(ClaimRef("ns", "c1", UID1))
    with pytest.raises(PrepareError, match="already prepared for claim ns/c1"):
        await p.prepare(ClaimRef("ns", "c2", UID2))
    assert p.store.get(UID2) is None
    await p.unprepare(ClaimRef("ns", "c1", UID1))
    await p.prepare(ClaimRef("ns", "c2", UID2))


async def test_admin_access_holds_nothing(env: Any) -> None:
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["fuse-fuse"])
    env.source.add("ns", "c2", UID2, ["fuse-fuse"], admin=True)
    await p.prepare(ClaimRef("ns", "c1", UID1))
    got = await p.prepare(ClaimRef("ns", "c2", UID2))
    assert got[0].admin_access and p.held() == {"fuse": {"fuse": "prepared for DRA claim ns/c1"}}


@pytest.mark.parametrize(
    "devices, problem",
    [
        (["nope"], "no such device offered"),
        (["ser-ttyx1"], "health command failed"),
        (["fuse-fuse"], "in use through the device plugin"),
    ],
)
async def test_refusals_change_nothing(env: Any, devices: list[str], problem: str) -> None:
    env.devices.dp_held.add(("fuse", "fuse"))
    p = env.preparer()
    env.source.add("ns", "c1", UID1, devices)
    with pytest.raises(PrepareError, match=problem):
        await p.prepare(ClaimRef("ns", "c1", UID1))
    assert p.store.all() == [] and not env.cdi.exists() and p.held() == {}


async def test_other_pool_uid_and_missing_claim(env: Any) -> None:
    p = env.preparer()
    env.source.add("ns", "c1", UID2, ["fuse-fuse"])
    with pytest.raises(PrepareError, match="deleted and made again"):
        await p.prepare(ClaimRef("ns", "c1", UID1))
    with pytest.raises(PrepareError, match="not found"):
        await p.prepare(ClaimRef("ns", "gone", UID1))
    env.source.add("ns", "c3", UID1, ["fuse-fuse"], pool="node-2")
    with pytest.raises(PrepareError, match="not this node's"):
        await p.prepare(ClaimRef("ns", "c3", UID1))


async def test_failed_reset_undoes_everything(env: Any) -> None:
    env.devices.reset_fails = True
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["ser-ttyx0"])
    with pytest.raises(PrepareError, match="exited with status 3"):
        await p.prepare(ClaimRef("ns", "c1", UID1))
    assert p.store.all() == [] and list(env.cdi.iterdir()) == [] and p.held() == {}


async def test_one_claim_is_never_prepared_twice_at_once(env: Any) -> None:
    """An unprepare that ends while another call for the claim waits must not let a third one run beside it."""
    env.devices.permits = asyncio.Semaphore(0)
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["ser-ttyx0"])
    first = asyncio.create_task(p.prepare(ClaimRef("ns", "c1", UID1)))
    await env.devices.reset_started.wait()
    undo = asyncio.create_task(p.unprepare(ClaimRef("ns", "c1", UID1)))
    waiting = asyncio.create_task(p.prepare(ClaimRef("ns", "c1", UID1)))
    await asyncio.sleep(0.05)
    env.devices.permits.release()
    await first
    await undo
    late = asyncio.create_task(p.prepare(ClaimRef("ns", "c1", UID1)))
    await asyncio.sleep(0.3)
    assert env.devices.most_resetting == 1  # the waiting prepare and the late one one after the other
    for _ in range(3):
        env.devices.permits.release()
    assert await waiting == await late
    assert env.devices.resets == ["ttyX0", "ttyX0"] and p.store.get(UID1).state == "prepared"


async def test_a_busy_claims_database_does_not_stop_the_event_loop(env: Any) -> None:
    """While another writer holds the database, the preparation waits in a worker thread and the loop goes on: the
    claim's devices are held (the step before its record is written) and this test runs, with the preparation still
    waiting, until it lets the other writer commit. On the event loop, the wait would have held everything until
    SQLite's busy timeout gave up."""
    p = env.preparer()
    env.source.add("ns", "c1", UID1, ["fuse-fuse"])
    other = sqlite3.connect(env.db, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        task = asyncio.create_task(p.prepare(ClaimRef("ns", "c1", UID1)))
        await eventually(lambda: p.held() == {"fuse": {"fuse": "prepared for DRA claim ns/c1"}}, 30, "the hold")
        assert not task.done() and p.store.get(UID1) is None
        other.execute("COMMIT")
    finally:
        other.close()
    assert [d.device for d in await asyncio.wait_for(task, 30)] == ["fuse-fuse"]
    assert p.store.get(UID1).state == "prepared"


def test_hostile_refs() -> None:
    for ns, name, uid in (("NS", "c", UID1), ("ns", "a/b", UID1), ("ns", "c", "x"), ("", "c", UID1)):
        with pytest.raises(PrepareError, match="claim: "):
            Preparer.check_ref(ns, name, uid)


def test_only_our_spec_files_are_removed(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a claim's CDI spec"):
        claimcdi.remove(tmp_path, "../other.json")
    with pytest.raises(ValueError):
        claimcdi.remove(tmp_path, "other.json")
    assert (tmp_path / "other.json").exists()


def test_store_schema_is_versioned(tmp_path: Path) -> None:
    s = ClaimStore(tmp_path / "c.db")
    s.close()
    with sqlite3.connect(tmp_path / "c.db") as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 1
        c.execute("PRAGMA user_version = 9")
    with pytest.raises(sqlite3.DatabaseError, match="newer"):
        ClaimStore(tmp_path / "c.db")
