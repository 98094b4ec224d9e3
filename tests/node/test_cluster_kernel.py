"""The cluster network's netlink edge on a real kernel, in a throw-away netns: the VXLAN device is kept as it is
across calls (same index, same MAC), routes/FDB/neighbours are written and read back, and nothing the agent does not
own (another protocol's route, another device) is touched. The uninstall's removal (cni/cluster/teardown.py, and
``install-cni --uninstall``'s side of it with no agent running) takes exactly the agent's objects away."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cni.cluster import kernel, masq, offload, teardown, uninstall
from cni.cluster.config import ClusterConfig
from cni.cluster.model import NodeInfo
from cni.cluster.plan import RouteSpec, State, changes
from cni.dataplane.bridge import ensure_bridge
from cni.dataplane.rtnl import Rtnl
from cni.install import network
from cni.netconf import BridgeConf
from cni.nodesubnets import NodeSubnets
from nodeplug.paths import Root

from support.host import needs_root, sh
from support.innetns import inside
from support.scriptedkube import scripted_client
from support.wait import eventually

pytestmark = needs_root
net, ip = ipaddress.ip_network, ipaddress.ip_address
PROTO = 110


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


def tx_checksum(ns: str) -> str:
    """``tx-checksum-ip-generic`` of the VXLAN device as ethtool(8) shows it ("on" / "off")."""
    shown = sh("ip", "netns", "exec", ns, "ethtool", "-k", kernel.VXLAN_DEVICE)
    return next(line.split(":")[1].split()[0] for line in shown.splitlines() if "tx-checksum-ip-generic" in line)


@pytest.mark.skipif(not shutil.which("ethtool"), reason="needs ethtool (Debian package ethtool; scripts/setup)")
def test_vxlan_tx_checksum_offload_is_set_as_configured_and_kept_so(node: str) -> None:
    """The checksum-offload workaround (cni.cluster.offload) on the real device: off or on as asked, set again when
    someone changes it behind the agent's back, the device itself kept; ``auto`` leaves it on from kernel 5.7."""

    def ensure(on: bool) -> kernel.VxlanDevice:
        return inside(node, lambda nl: kernel.ensure_vxlan(nl, "n1", 42, 4789, ip("192.168.50.1"),
                                                           kernel.underlay_of(nl, ip("192.168.50.1")),
                                                           tx_checksum_offload=on))  # fmt: skip

    first = ensure(False)
    assert tx_checksum(node) == "off"
    sh("ip", "netns", "exec", node, "ethtool", "-K", kernel.VXLAN_DEVICE, "tx-checksum-ip-generic", "on")
    assert ensure(False).ifindex == first.ifindex and tx_checksum(node) == "off"
    assert ensure(True).ifindex == first.ifindex and tx_checksum(node) == "on"
    auto = offload.wanted(ClusterConfig().vxlan.tx_checksum_offload)
    assert auto == (tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (5, 7))
    assert ensure(auto).ifindex == first.ifindex and tx_checksum(node) == ("on" if auto else "off")


def auto_mode_state() -> State:
    """Node-1's wanted state in auto mode: node-2 direct, node-4 over VXLAN (both families), its FDB and neighbours."""
    return State(
        {
            net("10.244.2.0/24"): RouteSpec(net("10.244.2.0/24"), ip("192.168.50.2"), False),
            net("fd44:0:0:2::/64"): RouteSpec(net("fd44:0:0:2::/64"), ip("fd50::2"), False),
            net("10.244.4.0/24"): RouteSpec(net("10.244.4.0/24"), ip("10.244.4.0"), True),
            net("fd44:0:0:4::/64"): RouteSpec(net("fd44:0:0:4::/64"), ip("fd44:0:0:4::"), True),
        },
        {"02:00:00:00:00:04": ip("192.168.60.4")},
        {ip("10.244.4.0"): "02:00:00:00:00:04", ip("fd44:0:0:4::"): "02:00:00:00:00:04"},
    )


def test_entries_are_written_read_back_and_only_ours_are_changed(node: str) -> None:
    sh("ip", "-n", node, "route", "add", "10.244.9.0/24", "via", "192.168.50.9", "proto", "static")

    def work(nl: Rtnl) -> tuple[kernel.Owned, kernel.Applied, kernel.Owned, kernel.Applied, kernel.Owned]:
        vx = kernel.ensure_vxlan(nl, "n1", 7, 4789, ip("192.168.50.1"), kernel.underlay_of(nl, ip("192.168.50.1")))
        want = auto_mode_state()
        want.routes[net("10.244.9.0/24")] = RouteSpec(net("10.244.9.0/24"), ip("192.168.50.99"), False)  # not ours
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
    assert problems.failed == [
        (net("10.244.9.0/24"), "route to 10.244.9.0/24: a route nodeplug does not own exists for it; left alone")
    ]
    assert problems.done == 7  # 4 routes, 1 FDB and 2 neighbour entries; the refused route is not counted
    assert set(back.state.routes) == {net("10.244.2.0/24"), net("fd44:0:0:2::/64"), net("10.244.4.0/24"),
                                      net("fd44:0:0:4::/64")}  # fmt: skip
    assert back.state.routes[net("10.244.4.0/24")].vxlan and not back.state.routes[net("10.244.2.0/24")].vxlan
    assert back.state.fdb == {"02:00:00:00:00:04": ip("192.168.60.4")}
    assert back.state.neigh == {ip("10.244.4.0"): "02:00:00:00:00:04", ip("fd44:0:0:4::"): "02:00:00:00:00:04"}
    assert net("10.244.9.0/24") in back.foreign
    assert problems2.failed == [] and problems2.done == 5
    assert set(after.state.routes) == {net("10.244.2.0/24"), net("fd44:0:0:2::/64")}
    assert after.state.fdb == {} and after.state.neigh == {}
    assert "10.244.9.0/24 via 192.168.50.9" in sh("ip", "-n", node, "route", "show", "proto", "static")


def test_connected_subnets_leave_out_pod_networks_loopback_and_link_local(node: str) -> None:
    sh("ip", "-n", node, "link", "add", "br9", "type", "bridge")
    sh("ip", "-n", node, "addr", "add", "10.244.1.1/24", "dev", "br9")
    got = inside(node, lambda nl: kernel.connected(nl, [net("10.244.0.0/16")]))
    assert set(got) == {net("192.168.50.0/24"), net("fd50::/64")}


def test_a_route_moving_from_the_underlay_to_vxlan_and_back_lands_in_both_families(node: str) -> None:
    """The kernel refuses to *replace* an IPv6 route via the underlay with an on-link one on the VXLAN device whose
    next hop lies in the route's own prefix: the change falls back to delete + add, and lands, both ways."""

    def work(nl: Rtnl) -> list[tuple[kernel.Applied, kernel.Owned]]:
        vx = kernel.ensure_vxlan(nl, "n1", 7, 4789, ip("192.168.50.1"), kernel.underlay_of(nl, ip("192.168.50.1")))
        direct = State(
            {
                net("10.244.2.0/24"): RouteSpec(net("10.244.2.0/24"), ip("192.168.50.2"), False),
                net("fd44:0:0:2::/64"): RouteSpec(net("fd44:0:0:2::/64"), ip("fd50::2"), False),
            },
            {},
            {},
        )
        vxlan = State(
            {
                net("10.244.2.0/24"): RouteSpec(net("10.244.2.0/24"), ip("10.244.2.0"), True),
                net("fd44:0:0:2::/64"): RouteSpec(net("fd44:0:0:2::/64"), ip("fd44:0:0:2::"), True),
            },
            {"02:00:00:00:00:02": ip("192.168.50.2")},
            {ip("10.244.2.0"): "02:00:00:00:00:02", ip("fd44:0:0:2::"): "02:00:00:00:00:02"},
        )
        have, seen = State.empty(), []
        for want in (direct, vxlan, direct):
            applied = kernel.apply(nl, changes(want, have), have, PROTO, vx.ifindex)
            seen.append((applied, kernel.read_owned(nl, PROTO, vx.ifindex)))
        return seen

    for (applied, owned), vx_way in zip(inside(node, work), (False, True, False), strict=True):
        assert applied.failed == []
        assert {r.vxlan for r in owned.state.routes.values()} == {vx_way}
        assert set(owned.state.routes) == {net("10.244.2.0/24"), net("fd44:0:0:2::/64")}


def test_a_refused_route_is_reported_and_the_peer_keeps_its_old_path(node: str) -> None:
    """A new path the kernel refuses even after the old route is gone (a gateway on no link) is counted as failed,
    and the old route is put back."""

    def work(nl: Rtnl) -> tuple[kernel.Applied, kernel.Owned]:
        old = RouteSpec(net("fd44:0:0:2::/64"), ip("fd50::2"), False)
        have = State.empty()
        kernel.apply(nl, changes(State({old.dst: old}, {}, {}), have), have, PROTO, None)
        unreachable = RouteSpec(old.dst, ip("fd99::9"), False)
        applied = kernel.apply(nl, changes(State({old.dst: unreachable}, {}, {}), have), have, PROTO, None)
        return applied, kernel.read_owned(nl, PROTO, None)

    applied, owned = inside(node, work)
    assert applied.done == 0 and len(applied.failed) == 1
    dst, why = applied.failed[0]
    assert dst == net("fd44:0:0:2::/64") and "keeps its old route via fd50::2" in why
    assert owned.state.routes[net("fd44:0:0:2::/64")].gateway == ip("fd50::2")


def test_the_path_to_an_address_names_the_route_and_its_owner(node: str) -> None:
    sh("ip", "-n", node, "route", "add", "default", "via", "192.168.50.254")
    sh("ip", "-n", node, "route", "add", "10.9.0.0/16", "via", "192.168.50.7", "proto", str(PROTO))
    gateways = inside(node, kernel.default_gateways)
    ours = inside(node, lambda nl: kernel.path_to(nl, ip("10.9.1.1")))
    out = inside(node, lambda nl: kernel.path_to(nl, ip("8.8.8.8")))
    assert gateways == [ip("192.168.50.254")]
    assert ours == kernel.RoutePath(net("10.9.0.0/16"), PROTO, ip("192.168.50.7"))
    assert out is not None and out.dst == net("0.0.0.0/0") and out.protocol != PROTO


# ---------------------------------------------------------------- uninstall: the removal


def agent_state(nl: Rtnl) -> None:
    """What an agent in auto mode leaves in its netns: direct and VXLAN routes (both families), FDB, neighbours, the
    masquerade table."""
    vx = kernel.ensure_vxlan(nl, "n1", 7, 4789, ip("192.168.50.1"), kernel.underlay_of(nl, ip("192.168.50.1")))
    want = auto_mode_state()
    assert kernel.apply(nl, changes(want, State.empty()), State.empty(), PROTO, vx.ifindex).failed == []
    masq.install([net("10.244.1.0/24"), net("fd44:0:0:1::/64")], [net("10.244.0.0/16"), net("fd44::/48")])


def foreign_state(node: str) -> None:
    """Things that are not the agent's: other protocols, another table, another device, another nft table."""
    sh("ip", "-n", node, "route", "add", "10.244.9.0/24", "via", "192.168.50.9", "proto", "static")
    sh("ip", "-n", node, "route", "add", "10.244.8.0/24", "via", "192.168.50.8", "proto", "111")
    sh("ip", "-n", node, "route", "add", "10.244.7.0/24", "via", "192.168.50.7", "proto", "110", "table", "100")
    sh("ip", "-n", node, "link", "add", "other0", "type", "bridge")
    sh("ip", "netns", "exec", node, "nft", "add", "table", "inet", "other")


def owned_left(node: str) -> dict[str, object]:
    """What of the agent's is still in the netns (empty values when nothing)."""
    routes = [sh("ip", "-n", node, f"-{v}", "route", "show", "proto", "110").strip() for v in (4, 6)]
    return {
        "routes": [r for r in routes if r],
        "vxlan": sh("ip", "-n", node, "link", "show", kernel.VXLAN_DEVICE, check=False).strip(),
        "tables": [t for t in sh("ip", "netns", "exec", node, "nft", "list", "tables").splitlines() if "nodeplug" in t],
    }


def assert_foreign_kept(node: str) -> None:
    assert "10.244.9.0/24" in sh("ip", "-n", node, "route", "show", "proto", "static")
    assert "10.244.8.0/24" in sh("ip", "-n", node, "route", "show", "proto", "111")
    assert "10.244.7.0/24" in sh("ip", "-n", node, "route", "show", "table", "100", "proto", "110")
    assert "other0" in sh("ip", "-n", node, "link", "show", "other0")
    assert "table inet other" in sh("ip", "netns", "exec", node, "nft", "list", "tables")


def write_subnets(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(NodeSubnets("n1", ("10.244.1.0/24", "fd44:0:0:1::/64"), 1450).dumps())


def test_removal_takes_exactly_the_agents_objects_and_is_idempotent(node: str, tmp_path: Path) -> None:
    subnets = tmp_path / "cluster" / "subnets.json"
    write_subnets(subnets)
    (tmp_path / "cluster" / "notes.txt").write_text("not ours")
    inside(node, agent_state)
    foreign_state(node)
    assert all(owned_left(node).values())
    sh("ip", "netns", "exec", node, "bridge", "fdb", "show", "dev", kernel.VXLAN_DEVICE)
    first = inside(node, lambda nl: teardown.remove(nl, PROTO, subnets))
    assert first.failed == [] and first.kept == []
    assert len(first.removed) == 4 and "removed 4 route(s) of protocol 110" in first.removed[0], first.removed
    assert owned_left(node) == {"routes": [], "vxlan": "", "tables": []}
    assert not subnets.exists() and (tmp_path / "cluster" / "notes.txt").exists()
    assert_foreign_kept(node)
    again = inside(node, lambda nl: teardown.remove(nl, PROTO, subnets))
    assert (again.removed, again.kept, again.failed) == ([], [], [])


def test_removal_leaves_a_same_named_device_and_a_file_that_are_not_the_agents(node: str, tmp_path: Path) -> None:
    sh("ip", "-n", node, "link", "add", kernel.VXLAN_DEVICE, "type", "bridge")
    bogus = tmp_path / "subnets.json"
    bogus.write_text("someone else's file")
    done = inside(node, lambda nl: teardown.remove(nl, PROTO, bogus))
    assert done.removed == [] and done.failed == []
    assert "it is a bridge device" in done.kept[0] and "not a subnets file" in done.kept[1]
    assert bogus.read_text() == "someone else's file"
    assert sh("ip", "-n", node, "link", "show", kernel.VXLAN_DEVICE)


def test_install_cni_uninstall_with_no_agent_running_removes_what_the_agent_config_names(
    node: str, tmp_path: Path
) -> None:
    """With no agent running, ``install-cni --uninstall`` removes the routes of the config's protocol (here not the
    default) and its subnets file, in the netns the last agent recorded; the request stays until the next install."""
    root = Root(tmp_path)
    subnets = root("/var/lib/nodeplug/cluster/subnets.json")
    write_subnets(subnets)
    inside(node, agent_state)
    sh("ip", "-n", node, "route", "add", "10.244.5.0/24", "via", "192.168.50.5", "proto", "112")
    foreign_state(node)

    def last_agent(nl: Rtnl) -> None:
        lock = uninstall.Lock(root(uninstall.LOCK))
        assert lock.try_acquire()
        lock.write(uninstall.Record("n1", uninstall.this_netns(), 112, str(subnets), 1))
        lock.release()  # the agent is gone (stopped, or killed)

    inside(node, last_agent)
    said: list[str] = []
    inside(node, lambda nl: network.remove_cluster_network(root, said.append, 5, 112))
    assert "removed 1 route(s) of protocol 112: 10.244.5.0/24" in said[0], said
    assert f"removed {subnets}" in said and not subnets.exists()
    assert owned_left(node)["vxlan"] == "" and owned_left(node)["tables"] == []
    assert "10.244.2.0/24" in sh("ip", "-n", node, "route", "show", "proto", "110")  # 110 is not this agent's here
    assert_foreign_kept(node)
    assert uninstall.requested(root(uninstall.MARKER)) and not root(uninstall.LOCK).exists()
    # in another netns (here: the test's own), the same root's uninstall leaves the kernel alone
    assert network.on_this_node(root) is False  # no record left: a temporary root is nobody's node


@pytest.mark.parametrize("recorded", [16, 186, 113])
def test_a_lock_record_naming_another_protocol_or_subnets_file_is_not_obeyed(
    node: str, tmp_path: Path, recorded: int
) -> None:
    """A record (or a hand-edited one) saying the DHCP, BGP or any other protocol than the config's, and a subnets
    file elsewhere, removes nothing of theirs: the node's default route, the BGP route and that file stay."""
    root = Root(tmp_path)
    elsewhere = tmp_path / "precious" / "subnets.json"
    write_subnets(elsewhere)
    sh("ip", "-n", node, "route", "add", "default", "via", "192.168.50.254", "proto", "dhcp")
    sh("ip", "-n", node, "route", "add", "10.99.0.0/16", "via", "192.168.50.9", "proto", str(recorded))
    sh("ip", "-n", node, "route", "add", "10.244.5.0/24", "via", "192.168.50.5", "proto", str(PROTO))

    def last_agent(nl: Rtnl) -> None:
        lock = uninstall.Lock(root(uninstall.LOCK))
        assert lock.try_acquire()
        record = uninstall.Record("n1", uninstall.this_netns(), PROTO, str(elsewhere), 1).dumps()
        os.write(lock.fd or -1, record.replace(b'"routeProtocol": 110', f'"routeProtocol": {recorded}'.encode()))
        lock.release()

    inside(node, last_agent)
    said: list[str] = []
    inside(node, lambda nl: network.remove_cluster_network(root, said.append, 5, PROTO))
    assert "default via 192.168.50.254" in sh("ip", "-n", node, "route", "show", "proto", "dhcp")
    assert "10.99.0.0/16" in sh("ip", "-n", node, "route", "show", "proto", str(recorded))
    assert elsewhere.exists()
    if recorded == 113:  # a record that differs from the config: said so, and the config's are removed
        assert any("not obeyed" in line for line in said), said
        assert f"removed 1 route(s) of protocol {PROTO}: 10.244.5.0/24" in " ".join(said), said
    else:  # a reserved protocol makes it no record at all: a temporary root with none is nobody's node
        assert said == ["left the cluster network alone here: the agent of this root ran in another network "
                        "namespace; run the uninstall there"]  # fmt: skip


def test_the_uninstall_removes_only_a_pod_bridge_nodeplug_created(node: str) -> None:
    """The conflist names two bridges: the one a nodeplug ADD created goes with the uninstall, the one somebody else
    made under a name the conflist also names stays, though it has no port either."""

    def made_by_nodeplug(nl: Rtnl) -> None:
        ensure_bridge(nl, BridgeConf(name="net", cni_version="1.0.0", bridge="npbr-ours"), [])

    inside(node, made_by_nodeplug)
    sh("ip", "-n", node, "link", "add", "npbr-theirs", "type", "bridge")
    conf = {"plugins": [{"type": "nodeplug", "bridge": "npbr-ours"}, {"type": "nodeplug", "bridge": "npbr-theirs"}]}
    said: list[str] = []
    inside(node, lambda nl: network.remove_unused(conf, "nodeplug0", said.append))
    names = {link["ifname"] for link in json.loads(sh("ip", "-n", node, "-j", "link", "show"))}
    assert "npbr-ours" not in names and "npbr-theirs" in names, said
    assert "removed bridge npbr-ours" in said and any(
        "npbr-theirs in place: nodeplug did not create it" in s for s in said
    )


def test_the_uninstall_refuses_a_reserved_route_protocol(tmp_path: Path) -> None:
    with pytest.raises(network.NetworkError, match="one the kernel or a routing daemon uses"):
        network.remove_cluster_network(Root(tmp_path), print, 1, 16)


# ---------------------------------------------------------------- a pass of the agent, with a hostile Node


def node_json(info: NodeInfo) -> dict[str, Any]:
    """``info`` as the API server sends a Node."""
    return {
        "kind": "Node", "apiVersion": "v1", "metadata": {"name": info.name, "resourceVersion": "1"},
        "spec": {"podCIDRs": [str(c) for c in info.pod_cidrs]},
        "status": {"addresses": [{"type": "InternalIP", "address": str(a)} for a in info.internal_ips]},
    }  # fmt: skip


def api_server(tmp_path: Path, nodes: dict[str, NodeInfo]) -> Any:
    """A client of an API server (scripted, in this process) that lists ``nodes`` and has no change to tell."""
    listing = {
        "kind": "NodeList",
        "metadata": {"resourceVersion": "1"},
        "items": [node_json(n) for n in nodes.values()],
    }

    def answer(request: httpx2.Request) -> httpx2.Response:
        if request.url.params.get("watch") == "1":
            return httpx2.Response(200, content=b"")  # nothing changes
        return httpx2.Response(200, json=listing)

    return scripted_client(answer, tmp_path)


def one_pass(ns: str, tmp_path: Path, nodes: dict[str, NodeInfo], masquerade: bool) -> Any:
    """Node n1's agent (direct mode) in netns ``ns`` following an API server that lists ``nodes``: the outcome of
    its first pass over them."""
    from cni.cluster.network import ClusterNetwork
    from nodeplug.log import get_logger

    async def scenario() -> Any:
        kube = api_server(tmp_path, nodes)
        cfg = ClusterConfig(mode="direct", masquerade=masquerade)
        agent = ClusterNetwork(cfg, kube, "n1", tmp_path / "subnets.json", get_logger("cni"),
                               lock_path=tmp_path / "lock", marker_path=tmp_path / "marker")  # fmt: skip
        before = agent.outcome
        await agent.start()
        try:
            await eventually(lambda: agent.outcome is not before, 60, "the agent's first pass")
            return agent.outcome
        finally:
            await agent.stop()
            await kube.close()

    return inside(ns, lambda _nl: asyncio.run(scenario()))


def test_a_peer_claiming_part_of_the_underlay_is_refused_and_the_others_stay_routed(node: str, tmp_path: Path) -> None:
    """A Node whose podCIDR lies in a subnet this node is on (192.168.50.128/25 here) must neither get a route
    (it would take half the segment's traffic) nor take the segment out of the subnets peers are reached on
    directly (which once left every direct peer unrouted)."""
    nodes = {
        "n1": NodeInfo("n1", (net("10.244.1.0/24"),), (ip("192.168.50.1"),)),
        "n2": NodeInfo("n2", (net("10.244.2.0/24"),), (ip("192.168.50.2"),)),
        "n3": NodeInfo("n3", (net("192.168.50.128/25"),), (ip("192.168.50.3"),)),
    }
    outcome = one_pass(node, tmp_path, nodes, masquerade=False)
    assert outcome.paths == {("n2", 4): "direct"}
    assert "192.168.50.0/24, a subnet this node is connected to" in outcome.unrouted[("n3", 4)]
    routes = sh("ip", "-n", node, "route", "show", "proto", str(PROTO))
    assert "10.244.2.0/24 via 192.168.50.2" in routes and "192.168.50.128" not in routes


def test_the_doctor_names_the_node_whose_route_is_missing(node: str, tmp_path: Path) -> None:
    """b's IPv4 podCIDR is a's (so b gets no IPv4 route) while b's IPv6 one is routed: a missing route to the shared
    IPv4 network is a's. The check once took the owner from every node with a path, whatever its family. The
    doctor's check runs as ``nodeplug doctor`` runs it, against an API server listing the Nodes."""
    from cni.cluster.doctor import peers_routed
    from nodeplug.checks import CheckFailed

    nodes = {
        "n1": NodeInfo("n1", (net("10.244.1.0/24"),), (ip("192.168.50.1"),)),
        "a": NodeInfo("a", (net("10.244.7.0/24"), net("fd44:0:0:7::/64")), (ip("192.168.50.7"), ip("fd50::7"))),
        "b": NodeInfo("b", (net("10.244.7.0/24"), net("fd44:0:0:8::/64")), (ip("192.168.50.8"), ip("fd50::8"))),
    }

    async def check() -> str:
        kube = api_server(tmp_path, nodes)
        try:
            with pytest.raises(CheckFailed) as e:
                await peers_routed(ClusterConfig(mode="direct"), kube, "n1")
            return str(e.value)
        finally:
            await kube.close()

    said = inside(node, lambda _nl: asyncio.run(check()))
    assert said.startswith("mode direct: direct 3, vxlan 0;"), said
    assert "a: route to 10.244.7.0/24 missing, want via 192.168.50.7" in said
    assert "b: route to fd44:0:0:8::/64 missing, want via fd50::8" in said
    assert "b IPv4: not routed (podCIDR 10.244.7.0/24 overlaps node a's)" in said


def test_a_link_named_like_the_vxlan_device_that_is_not_one_is_left_alone(node: str) -> None:
    sh("ip", "-n", node, "link", "add", kernel.VXLAN_DEVICE, "type", "bridge")

    def work(nl: Rtnl) -> tuple[str, bool]:
        with pytest.raises(kernel.KernelError) as e:
            kernel.ensure_vxlan(nl, "n1", 7, 4789, ip("192.168.50.1"), kernel.underlay_of(nl, ip("192.168.50.1")))
        return str(e.value), kernel.remove_vxlan(nl)

    error, removed = inside(node, work)
    assert "is a bridge device, not nodeplug's" in error and removed is False
    details = json.loads(sh("ip", "-d", "-j", "-n", node, "link", "show", kernel.VXLAN_DEVICE))[0]
    assert details["linkinfo"]["info_kind"] == "bridge"


def test_masquerade_keeps_the_source_only_towards_podcidrs_in_no_conflict(node: str, tmp_path: Path) -> None:
    """Without configured cluster CIDRs, traffic to every Node's podCIDR keeps its pod source address, except to a
    podCIDR that is refused (here one claiming half the underlay): pod traffic to those hosts is masqueraded as
    before. A podCIDR shared with a node that keeps it stays in the set."""
    nodes = {
        "n1": NodeInfo("n1", (net("10.244.1.0/24"),), (ip("192.168.50.1"),)),
        "a": NodeInfo("a", (net("10.244.7.0/24"),), (ip("192.168.50.7"),)),
        "b": NodeInfo("b", (net("10.244.7.0/24"),), (ip("192.168.50.8"),)),
        "h": NodeInfo("h", (net("192.168.50.128/25"),), (ip("192.168.50.3"),)),
    }
    outcome = one_pass(node, tmp_path, nodes, masquerade=True)
    assert outcome.problems == [] and outcome.paths == {("a", 4): "direct"}
    table = sh("ip", "netns", "exec", node, "nft", "list", "table", "inet", masq.TABLE)
    assert "10.244.1.0/24" in table and "10.244.7.0/24" in table and "192.168.50.128" not in table, table
