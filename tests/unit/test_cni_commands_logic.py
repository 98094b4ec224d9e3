"""Orchestration logic with a fake dataplane and the in-memory store (the real dataplane is in tests/node)."""

from __future__ import annotations

import io
import json
from collections.abc import Collection, Sequence
from typing import Any

import pytest

from cni import commands, skel
from cni.errors import CniError
from cni.ipam.store import MemoryStore
from cni.netconf import BridgeConf
from cni.types import Interface, IPConfig, Result, Route

IPAM = {"type": "nodeplug", "ranges": [[{"subnet": "10.30.0.0/29"}], [{"subnet": "fd30::/64"}]]}
CONF: dict[str, Any] = {
    "cniVersion": "1.1.0",
    "name": "podnet",
    "type": "nodeplug",
    "isDefaultGateway": True,
    "ipam": IPAM,
}


class FakeDataplane:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_add: CniError | None = None
        self.fail_netns: CniError | None = None
        self.fail_check: CniError | None = None
        self.fail_status: CniError | None = None

    def check_netns(self, netns: str) -> None:
        self.calls.append(("check_netns", netns))
        if self.fail_netns:
            raise self.fail_netns

    def add(
        self, conf: BridgeConf, cid: str, netns: str, ifname: str, ips: Sequence[IPConfig], routes: Sequence[Route]
    ) -> list[Interface]:
        self.calls.append(("add", cid, netns, ifname, list(ips), list(routes)))
        if self.fail_add:
            raise self.fail_add
        bridge = [] if conf.routed else [Interface(conf.bridge, "02:00:00:00:00:01")]
        return [*bridge, Interface("veth1"), Interface(ifname, "02:00:00:00:00:02", netns)]

    def delete(self, conf: BridgeConf, cid: str, netns: str | None, ifname: str, ips: Sequence[IPConfig]) -> None:
        self.calls.append(("delete", cid, netns, ifname, list(ips)))

    def check(self, conf: BridgeConf, cid: str, netns: str, ifname: str, prev: Result) -> None:
        self.calls.append(("check", cid, netns, ifname, prev))
        if self.fail_check:
            raise self.fail_check

    def gc(self, conf: BridgeConf, valid: Collection[tuple[str, str]]) -> None:
        self.calls.append(("gc", sorted(valid)))

    def status(self, conf: BridgeConf) -> None:
        self.calls.append(("status",))
        if self.fail_status:
            raise self.fail_status


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def dp() -> FakeDataplane:
    return FakeDataplane()


def call(
    dp: FakeDataplane,
    store: MemoryStore,
    command: str,
    conf: dict[str, Any] = CONF,
    cid: str = "c1",
    netns: str = "/run/netns/p",
) -> tuple[int, Any]:
    env = {"CNI_COMMAND": command, "CNI_CONTAINERID": cid, "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni"}
    if netns:
        env["CNI_NETNS"] = netns
    out = io.StringIO()
    code = skel.run(commands.table(dp, lambda d, n: store), env, json.dumps(conf).encode(), out)
    return code, json.loads(out.getvalue()) if out.getvalue() else None


def test_add_leases_builds_and_reports(dp: FakeDataplane, store: MemoryStore) -> None:
    code, out = call(dp, store, "ADD")
    assert code == 0, out
    assert out["ips"] == [
        {"address": "10.30.0.2/29", "gateway": "10.30.0.1", "interface": 2},
        {"address": "fd30::2/64", "gateway": "fd30::1", "interface": 2},
    ]
    assert out["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.30.0.1"}, {"dst": "::/0", "gw": "fd30::1"}]
    assert out["interfaces"][2] == {"name": "eth0", "mac": "02:00:00:00:00:02", "sandbox": "/run/netns/p"}
    assert dp.calls[0] == ("check_netns", "/run/netns/p")  # first, before anything is leased
    _, cid, netns, ifname, ips, routes = dp.calls[1]
    assert (cid, netns, ifname) == ("c1", "/run/netns/p", "eth0")
    assert all(ip.interface is None for ip in ips) and len(routes) == 2
    assert len(store.leases) == 2


def test_routed_add_reports_host_addresses_via_the_link_local_gateway(dp: FakeDataplane, store: MemoryStore) -> None:
    conf = {**CONF, "datapath": "routed", "ipam": {**IPAM, "routes": [{"dst": "192.168.0.0/16"}]}}
    code, out = call(dp, store, "ADD", conf)
    assert code == 0, out
    assert out["ips"] == [
        {"address": "10.30.0.2/32", "gateway": "169.254.1.1", "interface": 1},
        {"address": "fd30::2/128", "gateway": "fe80::1", "interface": 1},
    ]
    assert out["routes"] == [
        {"dst": "192.168.0.0/16", "gw": "169.254.1.1"},
        {"dst": "0.0.0.0/0", "gw": "169.254.1.1"},
        {"dst": "::/0", "gw": "fe80::1"},
        {"dst": "10.30.0.0/29", "gw": "169.254.1.1"},  # the subnet a bridged pod would reach on its link
        {"dst": "fd30::/64", "gw": "fe80::1"},
    ]
    assert [i["name"] for i in out["interfaces"]] == ["veth1", "eth0"]
    _, _, _, _, ips, _ = dp.calls[1]  # the dataplane gets the leases with their subnets (masquerade rules need them)
    assert [str(ip.address) for ip in ips] == ["10.30.0.2/29", "fd30::2/64"]


def test_route_without_gw_gets_its_family_gateway(dp: FakeDataplane, store: MemoryStore) -> None:
    conf = {
        **CONF,
        "isDefaultGateway": False,
        "ipam": {**IPAM, "routes": [{"dst": "192.168.0.0/16"}, {"dst": "0.0.0.0/0"}]},
    }
    code, out = call(dp, store, "ADD", conf)
    assert code == 0
    assert out["routes"] == [{"dst": "192.168.0.0/16", "gw": "10.30.0.1"}, {"dst": "0.0.0.0/0", "gw": "10.30.0.1"}]


def test_failed_dataplane_leaves_no_lease(dp: FakeDataplane, store: MemoryStore) -> None:
    dp.fail_add = CniError(101, details="veth: File exists")
    code, out = call(dp, store, "ADD")
    assert code == 1 and out["code"] == 101 and "veth" in out["details"]
    assert store.leases == {}


def test_del_passes_the_leased_addresses_then_releases(dp: FakeDataplane, store: MemoryStore) -> None:
    call(dp, store, "ADD")
    code, out = call(dp, store, "DEL", netns="")
    assert (code, out) == (0, None)
    kind, cid, netns, ifname, ips = dp.calls[-1]
    assert (kind, cid, netns, ifname) == ("delete", "c1", None, "eth0")
    assert [str(ip.address) for ip in ips] == ["10.30.0.2/29", "fd30::2/64"]
    assert store.leases == {}
    assert call(dp, store, "DEL")[0] == 0  # again: idempotent


def test_check(dp: FakeDataplane, store: MemoryStore) -> None:
    _, added = call(dp, store, "ADD")
    code, out = call(dp, store, "CHECK", {**CONF, "prevResult": added})
    assert (code, out) == (0, None)
    assert dp.calls[-1][0] == "check" and isinstance(dp.calls[-1][4], Result)
    code, out = call(dp, store, "CHECK", CONF)
    assert code == 1 and "prevResult" in out["details"]
    code, out = call(dp, store, "CHECK", {**CONF, "prevResult": {**added, "ips": [{"address": "10.30.0.6/29"}]}})
    assert code == 1 and out["code"] == 7 and "not leased" in out["details"]


def test_a_bad_netns_leases_nothing(dp: FakeDataplane, store: MemoryStore) -> None:
    dp.fail_netns = CniError(4, details="CNI_NETNS /tmp/fifo: not a network namespace file")
    code, out = call(dp, store, "ADD", netns="/tmp/fifo")
    assert code == 1 and out["code"] == 4 and store.leases == {}
    assert [c[0] for c in dp.calls] == ["check_netns"]


@pytest.mark.parametrize(
    ("prev", "needle"),
    [
        ({"interfaces": [{"name": "eth0"}], "ips": [{"address": "10.30.0.2/29"}]}, "no interface eth0 with a sandbox"),
        ({"interfaces": [{"name": "eth1", "sandbox": "/run/netns/p"}]}, "no interface eth0"),
        ({"ips": [{"address": "10.30.0.2/29", "interface": 4}]}, "prevResult.ips[0].interface"),
        ({"interfaces": "eth0"}, "prevResult.interfaces"),
        ([], "prevResult"),
    ],
)
def test_check_with_a_malformed_prev_result_is_a_config_error(
    dp: FakeDataplane, store: MemoryStore, prev: Any, needle: str
) -> None:
    call(dp, store, "ADD")
    code, out = call(dp, store, "CHECK", {**CONF, "prevResult": prev})
    assert code == 1 and out["code"] == 7 and needle in out["details"], out
    assert dp.calls[-1][0] == "add"  # the dataplane was not asked


def test_check_after_del_is_unknown_container(dp: FakeDataplane, store: MemoryStore) -> None:
    _, added = call(dp, store, "ADD")
    assert call(dp, store, "DEL")[0] == 0
    code, out = call(dp, store, "CHECK", {**CONF, "prevResult": added})
    assert code == 1 and out["code"] == 3 and "holds no address" in out["details"]  # nothing to clean up


def test_check_of_an_attachment_the_host_lost_is_a_failed_check(dp: FakeDataplane, store: MemoryStore) -> None:
    _, added = call(dp, store, "ADD")
    dp.fail_check = CniError(3, details="container c1 ifname eth0 is not attached (no host interface veth1)")
    code, out = call(dp, store, "CHECK", {**CONF, "prevResult": added})
    assert code == 1 and out["code"] == 101 and "no host interface" in out["details"]  # its lease still needs a DEL


def test_gc_releases_all_but_the_valid(dp: FakeDataplane, store: MemoryStore) -> None:
    for cid in ("a", "b", "c"):
        call(dp, store, "ADD", cid=cid)
    code, _ = call(dp, store, "GC", {**CONF, "cni.dev/valid-attachments": [{"containerID": "b", "ifname": "eth0"}]})
    assert code == 0
    assert {x.container_id for x in store.leases.values()} == {"b"}
    assert dp.calls[-1] == ("gc", [("b", "eth0")])
    code, out = call(dp, store, "GC", CONF)
    assert code == 1 and out["code"] == 7 and "valid-attachments" in out["details"]


def test_status_reports_exhaustion_and_dataplane(dp: FakeDataplane, store: MemoryStore) -> None:
    assert call(dp, store, "STATUS")[0] == 0
    for i in range(5):  # .2-.6 of the /29 (gateway .1)
        assert call(dp, store, "ADD", cid=f"c{i}")[0] == 0
    code, out = call(dp, store, "STATUS")
    assert code == 1 and out["code"] == 50 and "no address left" in out["details"]
    call(dp, store, "DEL", cid="c0")
    dp.fail_status = CniError(50, details="nft not found")
    code, out = call(dp, store, "STATUS")
    assert code == 1 and out["details"] == "nft not found"


def test_ipam_plugin_mode(dp: FakeDataplane, store: MemoryStore) -> None:
    conf = {
        "cniVersion": "1.0.0",
        "name": "refnet",
        "type": "bridge",
        "ipam": {**IPAM, "routes": [{"dst": "0.0.0.0/0"}]},
    }
    code, out = call(dp, store, "ADD", conf)
    assert code == 0
    assert out == {
        "cniVersion": "1.0.0",
        "ips": [{"address": "10.30.0.2/29", "gateway": "10.30.0.1"}, {"address": "fd30::2/64", "gateway": "fd30::1"}],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {},
    }
    assert dp.calls == []  # IPAM only
    assert call(dp, store, "CHECK", {**conf, "prevResult": out})[0] == 0
    assert call(dp, store, "DEL", conf)[0] == 0
    assert store.leases == {}


def test_requested_ip_through_runtime_config(dp: FakeDataplane, store: MemoryStore) -> None:
    code, out = call(dp, store, "ADD", {**CONF, "runtimeConfig": {"ips": ["10.30.0.5/29"]}})
    assert code == 0 and out["ips"][0]["address"] == "10.30.0.5/29"


def test_failed_repeat_add_keeps_the_existing_lease(dp: FakeDataplane, store: MemoryStore) -> None:
    assert call(dp, store, "ADD")[0] == 0
    dp.fail_add = CniError(101, details="veth exists")
    assert call(dp, store, "ADD")[0] == 1
    assert {x.container_id for x in store.leases.values()} == {"c1"}  # the live attachment keeps its address
