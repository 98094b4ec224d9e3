"""The cluster network's netlink edge on a real kernel, in a throw-away netns: the VXLAN device is kept as it is
across calls (same index, same MAC), routes/FDB/neighbours are written and read back, and nothing the agent does not
own (another protocol's route, another device) is touched."""

from __future__ import annotations

import ipaddress
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from cni.cluster import kernel
from cni.cluster.plan import RouteSpec, State, changes
from cni.dataplane.netns import entered
from cni.dataplane.rtnl import Rtnl

from support.host import needs_root, sh

pytestmark = needs_root
net, ip = ipaddress.ip_network, ipaddress.ip_address
PROTO = 110


def inside(ns: str, fn: Callable[[Rtnl], Any]) -> Any:
    """Run ``fn`` with a netlink socket of netns ``ns``, on a thread that stays there for it."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            with entered(fd):
                nl = Rtnl()
                try:
                    out.append(fn(nl))
                finally:
                    nl.close()
        except BaseException as e:
            err.append(e)
        finally:
            os.close(fd)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


@pytest.fixture
def node(netns: Callable[[], str]) -> str:
    ns = netns()
    sh("ip", "-n", ns, "link", "add", "eth0", "mtu", "1400", "type", "veth", "peer", "name", "eth0p")
    sh("ip", "-n", ns, "link", "set", "eth0p", "up")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "-n", ns, "addr", "add", "192.168.50.1/24", "dev", "eth0")
    sh("ip", "-n", ns, "addr", "add", "fd50::1/64", "dev", "eth0", "nodad")
    return ns


def test_vxlan_device_is_kept_as_it_is_and_recreated_only_when_its_settings_change(node: str) -> None:
    def ensure(vni: int) -> kernel.VxlanDevice:
        return inside(node, lambda nl: kernel.ensure_vxlan(nl, "n1", vni, 4789, ip("192.168.50.1"),
                                                           kernel.underlay_of(nl, ip("192.168.50.1"))))  # fmt: skip

    first = ensure(42)
    assert first.created and first.mtu == 1350 and first.mac == kernel.vtep_mac("n1", 42)
    again = ensure(42)
    assert not again.created and (again.ifindex, again.mac) == (first.ifindex, first.mac)
    details = json.loads(sh("ip", "-d", "-j", "-n", node, "link", "show", kernel.VXLAN_DEVICE))[0]
    data = details["linkinfo"]["info_data"]
    assert (data["id"], data["port"], data["local"], data["learning"]) == (42, 4789, "192.168.50.1", False)
    other = ensure(43)
    assert other.created and other.mac == kernel.vtep_mac("n1", 43)
    assert inside(node, kernel.remove_vxlan) is True
    assert inside(node, kernel.remove_vxlan) is False


def test_entries_are_written_read_back_and_only_ours_are_changed(node: str) -> None:
    sh("ip", "-n", node, "route", "add", "10.244.9.0/24", "via", "192.168.50.9", "proto", "static")

    def work(nl: Rtnl) -> tuple[kernel.Owned, list[str], kernel.Owned, list[str], kernel.Owned]:
        vx = kernel.ensure_vxlan(nl, "n1", 7, 4789, ip("192.168.50.1"), kernel.underlay_of(nl, ip("192.168.50.1")))
        want = State(
            {
                net("10.244.2.0/24"): RouteSpec(net("10.244.2.0/24"), ip("192.168.50.2"), False),
                net("fd44:0:0:2::/64"): RouteSpec(net("fd44:0:0:2::/64"), ip("fd50::2"), False),
                net("10.244.4.0/24"): RouteSpec(net("10.244.4.0/24"), ip("10.244.4.0"), True),
                net("fd44:0:0:4::/64"): RouteSpec(net("fd44:0:0:4::/64"), ip("fd44:0:0:4::"), True),
                net("10.244.9.0/24"): RouteSpec(net("10.244.9.0/24"), ip("192.168.50.99"), False),  # not ours
            },
            {"02:00:00:00:00:04": ip("192.168.60.4")},
            {ip("10.244.4.0"): "02:00:00:00:00:04", ip("fd44:0:0:4::"): "02:00:00:00:00:04"},
        )
        have = State.empty()
        problems = kernel.apply(nl, changes(want, have), have, PROTO, vx.ifindex)
        back = kernel.read_owned(nl, PROTO, vx.ifindex)
        have2 = State(dict(back.state.routes), dict(back.state.fdb), dict(back.state.neigh))
        # a peer leaves: everything of it goes, the rest stays
        want.routes.pop(net("10.244.4.0/24"))
        want.routes.pop(net("fd44:0:0:4::/64"))
        want.routes.pop(net("10.244.9.0/24"))
        want.fdb.clear()
        want.neigh.clear()
        ch = changes(want, have2)
        problems2 = kernel.apply(nl, ch, have2, PROTO, vx.ifindex)
        assert have2 == kernel.read_owned(nl, PROTO, vx.ifindex).state  # apply() keeps its record true
        return back, problems, kernel.read_owned(nl, PROTO, vx.ifindex), problems2, back

    back, problems, after, problems2, _ = inside(node, work)
    assert problems == ["route to 10.244.9.0/24: a route nodeplug does not own exists for it; left alone"]
    assert set(back.state.routes) == {net("10.244.2.0/24"), net("fd44:0:0:2::/64"), net("10.244.4.0/24"),
                                      net("fd44:0:0:4::/64")}  # fmt: skip
    assert back.state.routes[net("10.244.4.0/24")].vxlan and not back.state.routes[net("10.244.2.0/24")].vxlan
    assert back.state.fdb == {"02:00:00:00:00:04": ip("192.168.60.4")}
    assert back.state.neigh == {ip("10.244.4.0"): "02:00:00:00:00:04", ip("fd44:0:0:4::"): "02:00:00:00:00:04"}
    assert net("10.244.9.0/24") in back.foreign
    assert problems2 == []
    assert set(after.state.routes) == {net("10.244.2.0/24"), net("fd44:0:0:2::/64")}
    assert after.state.fdb == {} and after.state.neigh == {}
    assert "10.244.9.0/24 via 192.168.50.9" in sh("ip", "-n", node, "route", "show", "proto", "static")


def test_connected_subnets_leave_out_pod_networks_loopback_and_link_local(node: str) -> None:
    sh("ip", "-n", node, "link", "add", "br9", "type", "bridge")
    sh("ip", "-n", node, "addr", "add", "10.244.1.1/24", "dev", "br9")
    got = inside(node, lambda nl: kernel.connected(nl, [net("10.244.0.0/16")]))
    assert set(got) == {net("192.168.50.0/24"), net("fd50::/64")}
