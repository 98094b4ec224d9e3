"""Holds between the device plugin and DRA (pure): the replica is the unit both sides hold. A shared device
(``replicas: N``) is N devices in the pool; a replica the device plugin allocated is withheld from the slice until
kubelet's pod-resources API stops listing it (restarts read the holds back from that API); a replica prepared for a
claim is unhealthy to the device plugin, and the device's other replicas stay offered on both sides."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkube.resources.resource_v1beta1 import ResourceClaim

from deviceplugin.config import Resource
from deviceplugin.discovery import Device, DeviceNode
from deviceplugin.dra.claims import ClaimError
from deviceplugin.dra.inventory import GRACE_SECONDS, DevicePluginHolds, InventoryView
from deviceplugin.dra.prepare import ClaimRef, Offered, PrepareError, Preparer
from deviceplugin.dra.store import ClaimStore
from deviceplugin.state import DeviceTable, Listed
from nodeplug.log import get_logger

DRIVER = "devices.nodeplug.io"
POOL = "node-1"
FUSE = Resource(name="fuse", devices=["/dev/fuse"], replicas=4, offer="both")
TUN = Resource(name="tun", devices=["/dev/net/tun"], offer="both")  # one replica: one device, one side
UIDS = [f"{i:08x}-2222-4333-8444-555555555555" for i in range(8)]


def listed(i: str) -> Listed:
    return Listed(i, Device(i.split("::")[0], ()), True)


def test_holds_released_when_no_pod_lists_them() -> None:
    h = DevicePluginHolds()
    names = {"fuse": "nodeplug.io/fuse"}
    assert h.allocated("fuse", [listed("fuse::0"), listed("fuse::1")], now=100.0)
    assert set(h.held) == {("fuse", "fuse::0"), ("fuse", "fuse::1")}  # those replicas, not the whole device
    # too young to judge: kubelet may not list it yet
    assert not h.reconcile({}, names, now=100.0 + GRACE_SECONDS / 2)
    assert len(h.held) == 2
    # listed by kubelet: kept however old; the other replica is released
    assert h.reconcile({"nodeplug.io/fuse": {"fuse::1"}}, names, now=1000.0)
    assert set(h.held) == {("fuse", "fuse::1")}
    # no pod lists it any more
    assert h.reconcile({"nodeplug.io/fuse": set()}, names, now=1000.0)
    assert not h.held


def test_holds_found_in_use_after_a_restart() -> None:
    h = DevicePluginHolds()
    names = {"fuse": "nodeplug.io/fuse", "tun": "nodeplug.io/tun"}
    assert h.reconcile({"nodeplug.io/tun": {"net-tun"}, "nodeplug.io/other": {"x"}}, names, now=5.0)
    assert set(h.held) == {("tun", "net-tun")}


@dataclass
class Runtime:
    """What the inventory view reads of a resource's runtime: its config and its (real) device table."""

    res: Resource
    table: DeviceTable


class Node:
    """The device plugin's tables of one node, the view DRA takes of them, and a preparer over both (with a real
    claims database): the pieces the driver wires together, driven through their public calls."""

    def __init__(self, tmp: Path) -> None:
        self.runtimes: dict[str, Runtime] = {}
        for res, dev in ((FUSE, Device("fuse", (DeviceNode("/dev/fuse", "/dev/fuse"),))),
                         (TUN, Device("net-tun", (DeviceNode("/dev/net/tun", "/dev/net/tun"),)))):  # fmt: skip
            t = DeviceTable(res.replicas)
            t.update([dev], now=0.0)
            self.runtimes[res.name] = Runtime(res, t)
        self.view = InventoryView(lambda: self.runtimes)  # type: ignore[arg-type,return-value]
        self.claims: dict[tuple[str, str], Any] = {}
        self.preparer = Preparer(
            driver=DRIVER, pool=POOL, store=ClaimStore(tmp / "claims.db"), source=self, devices=self,
            cdi_dir=tmp / "cdi", log=get_logger("test"),
        )  # fmt: skip

    # ClaimSource
    async def get_claim(self, namespace: str, name: str) -> Any:
        if (namespace, name) not in self.claims:
            raise ClaimError(f"ResourceClaim {namespace}/{name} not found")
        return self.claims[(namespace, name)]

    # Devices
    def offered(self, name: str) -> Offered | None:
        return self.view.offered(name)

    def in_use_elsewhere(self, resource: str, unit: str) -> str:
        return self.view.in_use_elsewhere(resource, unit)

    def claims_changed(self) -> None:
        held = self.preparer.held()
        for name, rt in self.runtimes.items():
            rt.table.set_held(held.get(name, {}))

    async def reset(self, resource: Resource, devices: Any) -> None:
        pass

    # as kubelet and the device plugin drive it
    async def prepare(self, uid: str, devices: list[str]) -> None:
        name = f"c-{uid[:8]}"
        results = [{"request": "r", "driver": DRIVER, "pool": POOL, "device": d} for d in devices]
        self.claims[("ns", name)] = ResourceClaim.from_dict({
            "metadata": {"namespace": "ns", "name": name, "uid": uid}, "spec": {},
            "status": {"allocation": {"devices": {"results": results}}},
        })  # fmt: skip
        await self.preparer.prepare(ClaimRef("ns", name, uid))

    def dp_allocate(self, resource: str, replica: str) -> None:
        """What Allocate does: the entry it hands out, told to the DRA side."""
        entry = self.runtimes[resource].table.get(replica)
        assert entry is not None and entry.healthy, entry
        self.view.allocated(resource, [entry])

    def dp_healthy(self, resource: str) -> set[str]:
        return {e.id for e in self.runtimes[resource].table.listing if e.healthy}

    def slice_names(self) -> set[str]:
        self.view.invalidate()
        return {d.name for d in self.view.desired()}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.preparer.store.close()


def test_a_shared_device_is_as_many_devices_in_the_slice(node: Node) -> None:
    fuse = {f"fuse-fuse-{k}" for k in range(4)}
    assert node.slice_names() == fuse | {"tun-net-tun"}  # one replica keeps the plain name
    attrs = {d.name: dict(d.attributes) for d in node.view.desired()}
    assert all(attrs[n] == {"resource": "fuse", "kind": "node", "path": "/dev/fuse"} for n in fuse)
    assert {n: o.unit for n, o in node.view.snapshot().items()} == {
        **{f"fuse-fuse-{k}": f"fuse::{k}" for k in range(4)},
        "tun-net-tun": "net-tun",
    }


async def test_holds_are_shared_replica_by_replica(node: Node) -> None:
    # the device plugin hands out a replica: it leaves the slice, the others stay
    node.dp_allocate("fuse", "fuse::1")
    assert "fuse-fuse-1" not in node.slice_names() and "fuse-fuse-0" in node.slice_names()
    # a claim prepares another replica: only that one turns unhealthy to the device plugin
    await node.prepare(UIDS[0], ["fuse-fuse-2"])
    assert node.dp_healthy("fuse") == {"fuse::0", "fuse::1", "fuse::3"}
    assert node.runtimes["fuse"].table.get("fuse::2").reason == "prepared for DRA claim ns/c-00000000"  # type: ignore[union-attr]
    # a second claim on the same physical device, another replica: both hold it at once
    await node.prepare(UIDS[1], ["fuse-fuse-3"])
    assert node.dp_healthy("fuse") == {"fuse::0", "fuse::1"}
    # the replica the device plugin holds is refused to a claim allocated from an older slice
    with pytest.raises(PrepareError, match="in use through the device plugin"):
        await node.prepare(UIDS[2], ["fuse-fuse-1"])
    # and a replica a claim holds is refused to another claim
    with pytest.raises(PrepareError, match="already prepared for claim ns/c-00000000"):
        await node.prepare(UIDS[3], ["fuse-fuse-2"])
    await node.preparer.unprepare(ClaimRef("ns", "c-00000000", UIDS[0]))
    assert node.dp_healthy("fuse") == {"fuse::0", "fuse::1", "fuse::2"}
    # tun has one replica: a claim takes the device from the device plugin whole
    await node.prepare(UIDS[4], ["tun-net-tun"])
    assert node.dp_healthy("tun") == set()


def test_a_claim_recorded_with_the_physical_device_holds_every_replica() -> None:
    """A claim prepared before replicas were offered one by one recorded the physical device's ID."""
    t = DeviceTable(replicas=3)
    t.update([Device("fuse", ())], now=0.0)
    assert t.set_held({"fuse": "prepared for DRA claim ns/old", "fuse::1": "prepared for DRA claim ns/new"})
    assert [(e.id, e.reason) for e in t.listing] == [(f"fuse::{k}", "prepared for DRA claim ns/old") for k in range(3)]
    assert t.set_held({"fuse::1": "prepared for DRA claim ns/new"})
    assert [e.id for e in t.listing if e.healthy] == ["fuse::0", "fuse::2"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=12))
def test_never_more_holders_than_replicas(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[bool, int]]
) -> None:
    """Whatever the order of device-plugin allocations and claims, each replica has at most one holder: the two
    sides together never hand out more than the device's replicas, and a replica either side holds is not offered
    by the device plugin."""
    node = Node(tmp_path_factory.mktemp("inv"))
    dp: set[str] = set()
    dra: set[str] = set()

    async def run() -> None:
        for i, (through_dra, k) in enumerate(ops):
            replica = f"fuse::{k}"
            if through_dra:
                try:
                    await node.prepare(f"{i:08x}-2222-4333-8444-555555555555", [f"fuse-fuse-{k}"])
                    dra.add(replica)
                except PrepareError:
                    assert replica in dp | dra
            elif replica in node.dp_healthy("fuse") and replica not in dp:  # kubelet's device manager's own count
                node.dp_allocate("fuse", replica)
                dp.add(replica)
            elif replica not in dp:
                assert replica in dra  # the device plugin does not list it healthy: a claim holds it
            assert not dp & dra
            # the device plugin lists healthy what no claim holds (what it handed out itself, kubelet counts)
            assert node.dp_healthy("fuse") == {f"fuse::{j}" for j in range(4)} - dra
            # the slice lists what the device plugin does not hold (the scheduler knows what claims hold)
            assert node.slice_names() & {f"fuse-fuse-{j}" for j in range(4)} == {
                f"fuse-fuse-{j}" for j in range(4) if f"fuse::{j}" not in dp
            }

    asyncio.run(run())
    node.preparer.store.close()
