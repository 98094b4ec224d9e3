"""The CNI dataplane on real kernel objects: a test "host" netns (so the root netns is untouched) and pod netns.

Every dataplane call runs on a worker thread that has entered the test host netns, as the agent's worker threads run
in the node's netns; set-up and assertions use ip(8), nft(8) and ping(8) with ``-n``/``ip netns exec``. Tests taking
``host`` run on both datapaths (bridge, routed); ``bridge_host`` tests are about the bridge itself.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cni import datapath, dataplane
from cni.dataplane import masq, names
from cni.dataplane.netns import entered
from cni.errors import DATAPLANE, CniError
from cni.netconf import BridgeConf
from cni.types import Interface, IPConfig, Result, Route

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates netns, bridges and veth pairs")

T = TypeVar("T")
BR = "npbr0"
GW4, GW6 = "10.77.0.1", "fd77::1"
NODE4, NODE6 = "10.76.0.1", "fd76::1"  # the routed node's own addresses (on its loopback): what its pods can ping
FORWARDING6 = "net.ipv6.conf.all.forwarding"


class Host:
    """A test netns playing the node: :meth:`call` runs a function on a thread inside it; ``datapath`` is the one
    its configs (:meth:`conf`) name."""

    def __init__(self, name: str, sh: Callable[..., str], datapath: str = "bridge") -> None:
        self.name = name
        self.path = f"/run/netns/{name}"
        self.sh = sh  # support.host.sh: run a set-up command, raise with its stderr
        self.datapath = datapath
        self.routed = datapath == "routed"
        if self.routed:
            sh("ip", "-n", name, "addr", "add", f"{NODE4}/32", "dev", "lo")
            sh("ip", "-n", name, "addr", "add", f"{NODE6}/128", "dev", "lo")

    def conf(self, **kw: Any) -> BridgeConf:
        return conf(**{"datapath": self.datapath, **kw})

    def gw(self, version: int = 4) -> str:
        """The pods' gateway address (what their routes go via)."""
        if self.routed:
            return str(datapath.GATEWAY[version])
        return GW4 if version == 4 else GW6

    def node_addr(self, version: int = 4) -> str:
        """An address of the node a pod can ping: the bridge's gateway address, or (routed) one on its loopback."""
        if self.routed:
            return NODE4 if version == 4 else NODE6
        return GW4 if version == 4 else GW6

    def pod_addr(self, addr: str) -> str:
        """``addr`` (address/subnet prefix) as the pod has it: the routed datapath gives it alone (/32, /128)."""
        if not self.routed:
            return addr
        ip = ipaddress.ip_interface(addr)
        return f"{ip.ip}/{ip.max_prefixlen}"

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        def inside() -> T:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                with entered(fd):
                    try:
                        return fn(*args)
                    finally:
                        # whatever happened, the dataplane left this thread in the netns it was called from
                        assert os.stat("/proc/thread-self/ns/net").st_ino == os.fstat(fd).st_ino
            finally:
                os.close(fd)

        with ThreadPoolExecutor(1) as ex:
            return ex.submit(inside).result()

    def ip(self, *args: str) -> Any:
        return json.loads(self.sh("ip", "-n", self.name, "-j", *args) or "[]")

    def pod_ip(self, ns: str, *args: str) -> Any:
        return json.loads(self.sh("ip", "-n", os.path.basename(ns), "-j", *args) or "[]")

    def pod_addrs(self, ns: str, ifname: str = "eth0") -> dict[str, dict[str, Any]]:
        out = self.pod_ip(ns, "addr", "show", "dev", ifname)
        return {f"{a['local']}/{a['prefixlen']}": a for a in out[0]["addr_info"]} if out else {}

    def ping(self, ns: str, addr: str) -> None:
        self.sh("ip", "netns", "exec", os.path.basename(ns), "ping", "-c", "1", "-W", "2", addr)

    def link(self, name: str) -> dict[str, Any] | None:
        out = subprocess.run(["ip", "-n", self.name, "-j", "-d", "link", "show", name], capture_output=True, text=True)
        return json.loads(out.stdout)[0] if out.returncode == 0 else None

    def nft_rules(self) -> list[dict[str, Any]]:
        p = subprocess.run(
            ["ip", "netns", "exec", self.name, "nft", "-j", "list", "table", "inet", "nodeplug"],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            return []
        return [x["rule"] for x in json.loads(p.stdout)["nftables"] if "rule" in x]


@pytest.fixture(params=["bridge", "routed"])
def host(request: pytest.FixtureRequest, netns: Callable[[], str], sh: Callable[..., str]) -> Host:
    return Host(netns(), sh, request.param)


@pytest.fixture
def bridge_host(netns: Callable[[], str], sh: Callable[..., str]) -> Host:
    return Host(netns(), sh)


@pytest.fixture
def routed_host(netns: Callable[[], str], sh: Callable[..., str]) -> Host:
    return Host(netns(), sh, "routed")


@pytest.fixture
def pod(netns: Callable[[], str]) -> Callable[[], str]:
    def make() -> str:
        return f"/run/netns/{netns()}"

    return make


def conf(**kw: Any) -> BridgeConf:
    base = BridgeConf(name="nptest", cni_version="1.0.0", bridge=BR, is_gateway=True)
    return base._replace(**kw)


def v4(addr: str = "10.77.0.5/24", gw: str | None = GW4) -> IPConfig:
    return IPConfig(ipaddress.ip_interface(addr), ipaddress.ip_address(gw) if gw else None)


def v6(addr: str = "fd77::5/64", gw: str | None = GW6) -> IPConfig:
    return IPConfig(ipaddress.ip_interface(addr), ipaddress.ip_address(gw) if gw else None)


def default_routes(*ips: IPConfig) -> list[Route]:
    return [Route(ipaddress.ip_network("::/0" if ip.version == 6 else "0.0.0.0/0"), ip.gateway) for ip in ips]


def add(
    host: Host, c: BridgeConf, ns: str, cid: str = "c1", ifname: str = "eth0", ips: Any = None, routes: Any = None
) -> list[Interface]:
    """ADD as the orchestration calls it: on the routed datapath the addresses' gateway is the link-local one."""
    ips = [v4()] if ips is None else ips
    if c.routed:
        ips = [datapath.with_routed_gateway(ip) for ip in ips]
    routes = default_routes(*ips) if routes is None else routes
    return host.call(dataplane.add, c, cid, ns, ifname, ips, routes)


# ---------------------------------------------------------------- ADD


def test_add_builds_bridge_veth_addresses_routes_and_reaches_the_gateway(
    bridge_host: Host, pod: Callable[[], str]
) -> None:
    ns = pod()
    c = conf(mtu=1400)
    br, hv, ctr = add(bridge_host, c, ns)
    assert br.name == BR and hv.name == names.host_veth_name("c1", "eth0") and ctr.name == "eth0"
    assert ctr.sandbox == ns and not br.sandbox and not hv.sandbox

    bridge = bridge_host.link(BR)
    assert bridge is not None and bridge["linkinfo"]["info_kind"] == "bridge" and bridge["mtu"] == 1400
    assert bridge["address"] == br.mac and "UP" in bridge["flags"]
    assert [a["local"] for a in bridge_host.ip("addr", "show", "dev", BR)[0]["addr_info"] if a["family"] == "inet"] == [
        GW4
    ]

    port = bridge_host.link(hv.name)
    assert port is not None and port["master"] == BR and port["mtu"] == 1400 and "UP" in port["flags"]
    assert port["address"] == hv.mac and port["ifalias"] == "nodeplug nptest eth0 c1 +nomasq"
    # a bridge port carries frames: no address of its own, not even the IPv6 link-local one every link gets when up
    assert bridge_host.ip("addr", "show", "dev", hv.name)[0]["addr_info"] == []

    link = bridge_host.pod_ip(ns, "link", "show", "eth0")[0]
    assert link["address"] == ctr.mac and link["mtu"] == 1400 and "UP" in link["flags"]
    assert "10.77.0.5/24" in bridge_host.pod_addrs(ns)
    assert "UP" in bridge_host.pod_ip(ns, "link", "show", "lo")[0]["flags"]
    routes = bridge_host.pod_ip(ns, "route", "show", "default")
    assert [(r["gateway"], r["dev"]) for r in routes] == [(GW4, "eth0")]
    bridge_host.ping(ns, GW4)


def _root_sysctls() -> list[str]:
    keys = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding", "net/ipv6/conf/default/accept_dad")
    out = []
    for key in keys:
        with open(f"/proc/sys/{key}") as f:
            out.append(f.read().strip())
    return out


def test_dual_stack_addresses_are_usable_at_once(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    ips = [v4(), v6()]
    root_before = _root_sysctls()
    add(host, host.conf(), ns, ips=ips)
    assert _root_sysctls() == root_before  # /proc/sys/net follows the writing thread's netns, not the process's
    addrs = host.pod_addrs(ns)
    assert host.pod_addr("fd77::5/64") in addrs and host.pod_addr("10.77.0.5/24") in addrs
    assert not any(a.get("tentative") for a in addrs.values()), addrs
    assert (
        host.sh("ip", "netns", "exec", os.path.basename(ns), "sysctl", "-n", "net.ipv6.conf.eth0.accept_dad").strip()
        == "0"
    )
    if not host.routed:
        bridge6 = {a["local"] for a in host.ip("-6", "addr", "show", "dev", BR)[0]["addr_info"]}
        assert GW6 in bridge6
    assert host.pod_ip(ns, "-6", "route", "show", "default")[0]["gateway"] == host.gw(6)
    host.ping(ns, host.node_addr(6))
    host.ping(ns, host.node_addr(4))
    fwd = host.sh(
        "ip", "netns", "exec", host.name, "sysctl", "-n", "net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"
    )
    assert fwd.split() == ["1", "1"]


def test_a_network_below_the_ipv6_minimum_mtu_still_attaches_its_pods(
    bridge_host: Host, pod: Callable[[], str]
) -> None:
    """Below 1280 bytes the kernel gives a link no IPv6 at all, so the bridge port's IPv6 setting is not asked for
    (the kernel would refuse it, and the ADD with it)."""
    ns = pod()
    hv = add(bridge_host, conf(mtu=1200), ns)[-2]
    port = bridge_host.link(hv.name)
    assert port is not None and port["mtu"] == 1200 and "UP" in port["flags"]
    bridge_host.ping(ns, GW4)


def test_hairpin_and_promisc(bridge_host: Host, pod: Callable[[], str]) -> None:
    hv = add(bridge_host, conf(hairpin_mode=True, promisc_mode=True), pod())[-2]
    port = bridge_host.link(hv.name)
    assert port is not None and port["linkinfo"]["info_slave_data"]["hairpin"] is True
    assert "PROMISC" in (bridge_host.link(BR) or {})["flags"]


def test_link_routes_and_route_attributes(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    routes = [
        Route(ipaddress.ip_network("10.99.0.0/16"), ipaddress.ip_address(host.gw()), mtu=1300),
        Route(ipaddress.ip_network("10.98.0.0/16")),
        Route(ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_address(host.gw()), priority=50),
    ]
    add(host, host.conf(), ns, routes=routes)
    by_dst = {r["dst"]: r for r in host.pod_ip(ns, "-d", "route", "show")}
    assert by_dst["10.99.0.0/16"]["gateway"] == host.gw() and by_dst["10.99.0.0/16"]["metrics"] == [{"mtu": 1300}]
    assert by_dst["10.98.0.0/16"]["scope"] == "link" and "gateway" not in by_dst["10.98.0.0/16"]
    assert by_dst["default"]["metric"] == 50


def test_routed_pod_has_host_routes_a_link_local_gateway_and_no_bridge(
    routed_host: Host, pod: Callable[[], str]
) -> None:
    """The routed datapath: no bridge; the node routes each pod address (/32, /128) through the pod's host veth; the
    pod's default routes go on-link via 169.254.1.1 and fe80::1, permanent neighbours at the host veth's MAC."""
    node, ns = routed_host, pod()
    ifaces = add(node, node.conf(mtu=1400), ns, ips=[v4(), v6()])
    assert [i.name for i in ifaces] == [names.host_veth_name("c1", "eth0"), "eth0"]
    hv, ctr = ifaces
    assert node.link(BR) is None
    port = node.link(hv.name)
    assert port is not None and "master" not in port and port["address"] == hv.mac and port["mtu"] == 1400
    assert port["ifalias"] == "nodeplug nptest eth0 c1 +nomasq"  # the same names and marks as the bridge datapath
    assert not [a for a in node.ip("addr", "show", "dev", hv.name)[0]["addr_info"] if a["scope"] == "global"]
    on_veth = node.ip("route", "show", "dev", hv.name) + node.ip("-6", "route", "show", "dev", hv.name)
    host_routes = {r["dst"]: r for r in on_veth}
    assert {"10.77.0.5", "fd77::5"} <= set(host_routes) and host_routes["10.77.0.5"]["scope"] == "link"
    pod_addrs = set(node.pod_addrs(ns))
    assert {a for a in pod_addrs if not a.startswith("fe80:")} == {"10.77.0.5/32", "fd77::5/128"}
    neighbours = node.pod_ip(ns, "neigh", "show", "dev", "eth0") + node.pod_ip(ns, "-6", "neigh", "show", "dev", "eth0")
    neigh = {n["dst"]: n for n in neighbours}
    for gw in ("169.254.1.1", "fe80::1"):
        assert neigh[gw]["lladdr"] == hv.mac and neigh[gw]["state"] == ["PERMANENT"]
    for version in (4, 6):
        (default,) = node.pod_ip(ns, f"-{version}", "route", "show", "default")
        assert default["gateway"] == node.gw(version) and "onlink" in default["flags"]
    assert ctr.sandbox == ns and node.pod_ip(ns, "link", "show", "eth0")[0]["address"] == ctr.mac


def test_routed_pods_on_one_node_talk_through_its_routing_table(routed_host: Host, pod: Callable[[], str]) -> None:
    node, a, b = routed_host, pod(), pod()
    add(node, node.conf(), a, cid="ca", ips=[v4(), v6()])
    add(node, node.conf(), b, cid="cb", ips=[v4("10.77.0.6/24"), v6("fd77::6/64")])
    node.ping(a, "10.77.0.6")
    node.ping(b, "fd77::5")
    hops = node.sh("ip", "netns", "exec", os.path.basename(a), "ping", "-c1", "-W2", "10.77.0.6")
    assert "ttl=63" in hops  # one hop: the node routed it
    node.call(dataplane.delete, node.conf(), "cb", None, "eth0", [])
    assert node.ip("route", "show", "10.77.0.6") == []  # the host route went with the veth


def test_a_node_moving_over_keeps_bridged_and_routed_pods_of_one_subnet_talking(
    bridge_host: Host, pod: Callable[[], str]
) -> None:
    """A bridged pod sees its whole subnet on its link and asks for a routed pod's address there: the bridge answers
    for the routed pods (proxy ARP, a proxy NDP entry each), until they are gone (DEL, or GC for one DEL missed)."""
    node, bridged, routed = bridge_host, pod(), pod()
    add(node, conf(), bridged, cid="old", ips=[v4(), v6()])
    add(node, conf(datapath="routed"), routed, cid="new", ips=[v4("10.77.0.6/24"), v6("fd77::6/64")])
    for src, dst in ((bridged, "10.77.0.6"), (bridged, "fd77::6"), (routed, "10.77.0.5"), (routed, "fd77::5")):
        node.ping(src, dst)

    def proxied() -> list[str]:
        return [n["dst"] for n in node.ip("-6", "neigh", "show", "proxy", "dev", BR)]

    assert proxied() == ["fd77::6"]
    node.call(dataplane.delete, conf(), "new", None, "eth0", [v6("fd77::6/64")])
    assert proxied() == []
    add(node, conf(datapath="routed"), pod(), cid="gone", ips=[v6("fd77::7/64")])
    node.sh("ip", "-n", node.name, "link", "delete", names.host_veth_name("gone", "eth0"))  # its DEL never came
    assert proxied() == ["fd77::7"]
    node.call(dataplane.gc, conf(), [("old", "eth0")])
    assert proxied() == []
    node.ping(bridged, "10.77.0.1")


def test_two_pods_share_the_bridge_and_talk(bridge_host: Host, pod: Callable[[], str]) -> None:
    a, b = pod(), pod()
    add(bridge_host, conf(), a, cid="ca")
    add(bridge_host, conf(), b, cid="cb", ips=[v4("10.77.0.6/24")])
    bridge_host.ping(a, "10.77.0.6")
    ports = [link["ifname"] for link in bridge_host.ip("link", "show", "master", BR)]
    assert sorted(ports) == sorted([names.host_veth_name("ca", "eth0"), names.host_veth_name("cb", "eth0")])


def test_gateway_conflict_and_force_address(bridge_host: Host, pod: Callable[[], str]) -> None:
    add(bridge_host, conf(), pod(), cid="ca")
    other = [v4("10.78.0.5/24", "10.78.0.1")]
    with pytest.raises(CniError) as e:
        add(bridge_host, conf(), pod(), cid="cb", ips=other)
    assert e.value.code == DATAPLANE and "already has the address 10.77.0.1/24" in e.value.details
    assert bridge_host.link(names.host_veth_name("cb", "eth0")) is None
    add(bridge_host, conf(force_address=True), pod(), cid="cc", ips=other)
    v4s = [a["local"] for a in bridge_host.ip("addr", "show", "dev", BR)[0]["addr_info"] if a["family"] == "inet"]
    assert v4s == ["10.78.0.1"]


def test_not_a_bridge_is_refused(bridge_host: Host, pod: Callable[[], str]) -> None:
    bridge_host.sh("ip", "-n", bridge_host.name, "link", "add", BR, "type", "veth", "peer", "name", "npbr0peer")
    with pytest.raises(CniError, match="exists but is a veth device"):
        add(bridge_host, conf(), pod())
    with pytest.raises(CniError) as e:
        bridge_host.call(dataplane.status, conf())
    assert e.value.code == 50


# ---------------------------------------------------------------- masquerade, DEL, rollback


def test_masquerade_rules_added_and_removed_on_del(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    c = host.conf(ip_masq=True)
    hv = add(host, c, ns, ips=[v4(), v6()])[-2]
    rules = host.nft_rules()
    assert len(rules) == 2
    assert {r["comment"] for r in rules} == {f"nodeplug {hv.name} nptest c1"}
    text = host.sh("ip", "netns", "exec", host.name, "nft", "list", "table", "inet", "nodeplug")
    assert "ip saddr 10.77.0.5 ip daddr != 10.77.0.0/24 ip daddr != 224.0.0.0/4 masquerade" in text
    assert "ip6 saddr fd77::5 ip6 daddr != fd77::/64 ip6 daddr != ff00::/8 masquerade" in text
    host.call(dataplane.delete, c, "c1", ns, "eth0", [v4(), v6()])
    assert host.nft_rules() == []
    assert host.link(hv.name) is None
    assert host.pod_ip(ns, "link", "show") and not [x for x in host.pod_ip(ns, "link", "show") if x["ifname"] == "eth0"]


def test_del_twice_and_without_netns(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    c = host.conf(ip_masq=True)
    hv = add(host, c, ns)[-2]
    host.call(dataplane.delete, c, "c1", None, "eth0", [])
    assert host.link(hv.name) is None and host.nft_rules() == []
    host.call(dataplane.delete, c, "c1", None, "eth0", [])
    host.call(dataplane.delete, c, "c1", ns, "eth0", [v4()])
    host.call(dataplane.delete, c, "never-added", "/run/netns/gone", "eth0", [v4()])


def test_del_returns_with_the_pair_gone_and_the_attachment_can_be_added_again_at_once(
    host: Host, pod: Callable[[], str]
) -> None:
    """DEL answers before the kernel has finished freeing the pair (:mod:`cni.dataplane.unlink`), but never before
    both ends and their routes are gone: the same container can be attached again right away, same netns."""
    ns = pod()
    for _ in range(3):
        hv = add(host, host.conf(), ns, ips=[v4(), v6()])[-2]
        host.call(dataplane.delete, host.conf(), "c1", ns, "eth0", [])
        assert host.link(hv.name) is None
        assert [x["ifname"] for x in host.pod_ip(ns, "link", "show")] == ["lo"]
        assert host.ip("route", "show", "10.77.0.5") == [] and host.ip("-6", "route", "show", "fd77::5") == []


def test_del_after_the_netns_is_gone(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    c = host.conf(ip_masq=True)
    hv = add(host, c, ns)[-2]
    host.sh("ip", "netns", "delete", os.path.basename(ns))
    host.call(dataplane.delete, c, "c1", ns, "eth0", [v4()])
    assert host.link(hv.name) is None and host.nft_rules() == []


def test_del_removes_the_rules_even_when_ipmasq_was_turned_off_since(host: Host, pod: Callable[[], str]) -> None:
    add(host, host.conf(ip_masq=True), pod())
    assert len(host.nft_rules()) == 1
    host.call(dataplane.delete, host.conf(ip_masq=False), "c1", None, "eth0", [])
    assert host.nft_rules() == []


def test_del_leaves_another_network_rules_alone(host: Host, pod: Callable[[], str]) -> None:
    add(host, host.conf(ip_masq=True), pod(), cid="ca")
    add(host, host.conf(name="other", ip_masq=True), pod(), cid="cb", ips=[v4("10.77.0.6/24")])
    host.call(dataplane.delete, host.conf(ip_masq=True), "ca", None, "eth0", [])
    assert [r["comment"].split()[2] for r in host.nft_rules()] == ["other"]


def test_del_without_ipmasq_runs_no_nft(
    host: Host, pod: Callable[[], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Regression (issue 11, CNI 8): every DEL listed the nft chain, so 400 DELs at once timed out in nft. The nft
    the dataplane finds on PATH notes each run before it runs the real one."""
    real = shutil.which("nft")
    assert real is not None
    bindir, log = tmp_path / "bin", tmp_path / "nft-runs"
    bindir.mkdir()
    (bindir / "nft").write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    (bindir / "nft").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    add(host, host.conf(ip_masq=True), pod(), cid="masq", ips=[v4("10.77.0.9/24")])  # the wrapper notes its rules
    assert "-f -" in log.read_text()
    log.unlink()
    add(host, host.conf(), pod())
    host.call(dataplane.delete, host.conf(), "c1", None, "eth0", [])
    host.call(dataplane.delete, host.conf(), "never-added", None, "eth0", [])
    assert not log.exists() and host.link(names.host_veth_name("c1", "eth0")) is None


def test_an_nft_timeout_is_try_again_later_and_undone(
    host: Host, pod: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 11, CNI 8): nft timing out under load was code 101; it is transient: code 11."""
    monkeypatch.setattr(masq, "NFT_TIMEOUT", 0.000001)
    ns = pod()
    with pytest.raises(CniError) as e:
        add(host, host.conf(ip_masq=True), ns)
    assert e.value.code == 11 and "timed out" in e.value.details
    monkeypatch.undo()
    _nothing_left(host, ns)


@pytest.mark.parametrize("length", [233, 234, 300, 1000])
def test_long_container_ids(host: Host, pod: Callable[[], str], length: int) -> None:
    """Regression (issue 11, CNI 7): a container id of 234 characters or more overflowed the host veth's alias."""
    ns, cid = pod(), "c" * (length - 1) + "1"
    hv = add(host, host.conf(ip_masq=True), ns, cid=cid)[-2]
    alias = host.link(hv.name)["ifalias"]  # type: ignore[index]
    assert alias.startswith("nodeplug nptest eth0 ") and alias.endswith(" +masq") and len(alias.encode()) <= 254
    host.call(dataplane.delete, host.conf(ip_masq=True), cid, None, "eth0", [])
    _nothing_left(host, ns, cid)


def _nothing_left(host: Host, ns: str, cid: str = "c1") -> None:
    assert host.link(names.host_veth_name(cid, "eth0")) is None
    assert [x["ifname"] for x in host.pod_ip(ns, "link", "show")] == ["lo"]
    assert host.nft_rules() == []


def test_rollback_when_an_address_cannot_be_added(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    ips = [v4(), v4()]  # the second add of the same address fails with EEXIST
    with pytest.raises(CniError) as e:
        add(host, host.conf(ip_masq=True), ns, ips=ips)
    assert e.value.code == DATAPLANE and f"add address {host.pod_addr('10.77.0.5/24')} to eth0" in e.value.details
    _nothing_left(host, ns)


def test_rollback_when_ifname_exists_in_the_netns(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    host.sh("ip", "-n", os.path.basename(ns), "link", "add", "eth0", "type", "veth", "peer", "name", "podown0")
    with pytest.raises(CniError, match="interface eth0 already exists in the network namespace"):
        add(host, host.conf(ip_masq=True), ns)
    assert host.link(names.host_veth_name("c1", "eth0")) is None and host.nft_rules() == []
    assert sorted(x["ifname"] for x in host.pod_ip(ns, "link", "show")) == ["eth0", "lo", "podown0"]  # the pod's own


def test_rollback_when_a_route_fails_removes_the_rule_too(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    unreachable = [Route(ipaddress.ip_network("10.99.0.0/16"), ipaddress.ip_address("192.0.2.1"))]
    with pytest.raises(CniError, match=re.escape("add route 10.99.0.0/16 via 192.0.2.1 dev eth0")):
        add(host, host.conf(ip_masq=True), ns, routes=unreachable)
    _nothing_left(host, ns)


def test_rollback_when_the_pod_already_has_the_route_names_it(host: Host, pod: Callable[[], str]) -> None:
    """The pod side is one netlink batch: the error names the step the kernel refused, not the first or the last."""
    ns = pod()
    ip = datapath.with_routed_gateway(v4()) if host.conf().routed else v4()
    twice = [*default_routes(ip), Route(ipaddress.ip_network("10.98.0.0/16")), *default_routes(ip)]
    with pytest.raises(CniError) as e:
        add(host, host.conf(ip_masq=True), ns, routes=twice)
    assert e.value.code == DATAPLANE and e.value.details.endswith("a route to 0.0.0.0/0 already exists"), e.value
    _nothing_left(host, ns)


def test_a_routed_pod_address_the_node_routes_elsewhere_is_refused_and_undone(
    routed_host: Host, pod: Callable[[], str]
) -> None:
    node, a, b = routed_host, pod(), pod()
    add(node, node.conf(), a, cid="ca", ips=[v4(), v6()])
    with pytest.raises(CniError) as e:  # the second pod's IPv6 host route collides with the first pod's
        add(node, node.conf(), b, cid="cb", ips=[v4("10.77.0.6/24"), v6()])
    assert e.value.code == DATAPLANE and "route fd77::5/128: the node already routes this pod address" in str(e.value)
    assert node.link(names.host_veth_name("cb", "eth0")) is None
    assert node.ip("route", "show", "10.77.0.6") == []  # its IPv4 host route went with its veth
    first = names.host_veth_name("ca", "eth0")  # the first pod keeps its routes
    assert [r["dev"] for r in node.ip("-6", "route", "show", "fd77::5")] == [first]
    assert [r["dev"] for r in node.ip("route", "show", "10.77.0.5")] == [first]


def test_vlan(bridge_host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    try:
        hv = add(bridge_host, conf(vlan=100), ns)[-2]
    except CniError as e:
        # kernels without CONFIG_BRIDGE_VLAN_FILTERING: a clear error and nothing left behind
        assert "CONFIG_BRIDGE_VLAN_FILTERING" in e.details
        _nothing_left(bridge_host, ns)
        return
    vlans = json.loads(bridge_host.sh("bridge", "-n", bridge_host.name, "-j", "vlan", "show", "dev", hv.name))
    assert [v["vlan"] for v in vlans[0]["vlans"]] == [100]


def test_bad_netns(host: Host, tmp_path: Path) -> None:
    with pytest.raises(CniError) as e:
        add(host, host.conf(), "/run/netns/does-not-exist")
    assert e.value.code == 4 and "does-not-exist" in e.value.details
    (tmp_path / "plain").write_text("")
    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "plain", tmp_path / "fifo", Path("/dev/null"), tmp_path):
        for check in (dataplane.check_netns, lambda p: add(host, host.conf(), p)):
            with pytest.raises(CniError, match="not a network namespace file") as e:
                host.call(check, str(path))
            assert e.value.code == 4
    with pytest.raises(CniError, match="not a network namespace") as e:
        host.call(dataplane.check_netns, "/proc/self/ns/uts")
    for check in (dataplane.check_netns, lambda p: add(host, host.conf(), p)):
        with pytest.raises(CniError, match="host's own network namespace"):
            host.call(check, host.path)


# ---------------------------------------------------------------- CHECK, GC, STATUS


def _result(host: Host, ifaces: list[Interface], ips: list[IPConfig]) -> Result:
    """ADD's result as the orchestration builds it (routed: host addresses via the link-local gateway)."""
    if host.routed:
        ips = [datapath.host_address(datapath.with_routed_gateway(ip)) for ip in ips]
    pod = len(ifaces) - 1
    return Result("1.0.0", tuple(ifaces), tuple(ip._replace(interface=pod) for ip in ips), tuple(default_routes(*ips)))


def test_check_passes_then_detects_a_removed_address_and_route(host: Host, pod: Callable[[], str]) -> None:
    ns = pod()
    ips = [v4(), v6()]
    prev = _result(host, add(host, host.conf(mtu=1400), ns, ips=ips), ips)
    host.call(dataplane.check, host.conf(mtu=1400), "c1", ns, "eth0", prev)
    with pytest.raises(CniError, match="MTU is 1400, the network config says 1500"):
        host.call(dataplane.check, host.conf(mtu=1500), "c1", ns, "eth0", prev)
    host.sh("ip", "-n", os.path.basename(ns), "route", "del", "default")
    with pytest.raises(CniError, match=re.escape(f"route 0.0.0.0/0 via {host.gw()} is missing")):
        host.call(dataplane.check, host.conf(mtu=1400), "c1", ns, "eth0", prev)
    host.sh("ip", "-n", os.path.basename(ns), "addr", "del", host.pod_addr("fd77::5/64"), "dev", "eth0")
    with pytest.raises(CniError, match=f"address {host.pod_addr('fd77::5/64')} is missing"):
        host.call(dataplane.check, host.conf(mtu=1400), "c1", ns, "eth0", prev)
    bad_mac = prev._replace(interfaces=(*prev.interfaces[:-1], prev.interfaces[-1]._replace(mac="02:00:00:00:00:01")))
    with pytest.raises(CniError, match="MAC is"):
        host.call(dataplane.check, host.conf(mtu=1400), "c1", ns, "eth0", bad_mac)
    host.call(dataplane.delete, host.conf(), "c1", ns, "eth0", ips)
    with pytest.raises(CniError, match=r"not attached \(no host interface veth[0-9a-f]{8}\)") as gone:
        host.call(dataplane.check, host.conf(mtu=1400), "c1", ns, "eth0", prev)
    assert gone.value.code == 3  # CHECK after DEL: nothing of the attachment is left


def test_check_of_a_routed_pod_verifies_its_host_routes_and_gateway_neighbours(
    routed_host: Host, pod: Callable[[], str]
) -> None:
    node, ns, ips = routed_host, pod(), [v4(), v6()]
    prev = _result(node, add(node, node.conf(), ns, ips=ips), ips)
    hv = prev.interfaces[0].name
    node.call(dataplane.check, node.conf(), "c1", ns, "eth0", prev)
    node.sh("ip", "-n", os.path.basename(ns), "neigh", "replace", "fe80::1", "lladdr", "02:00:00:00:00:01", "dev",
            "eth0", "nud", "permanent")  # fmt: skip
    with pytest.raises(CniError, match="gateway fe80::1 is not a permanent neighbour"):
        node.call(dataplane.check, node.conf(), "c1", ns, "eth0", prev)
    node.sh("ip", "-n", node.name, "route", "del", "10.77.0.5/32", "dev", hv)
    with pytest.raises(CniError, match=f"the node has no route to 10.77.0.5 through {hv}") as e:
        node.call(dataplane.check, node.conf(), "c1", ns, "eth0", prev)
    assert e.value.code == 101


def test_check_judges_each_pod_by_the_datapath_it_was_made_with(host: Host, pod: Callable[[], str]) -> None:
    """A node moving between datapaths keeps its pods: CHECK under the other datapath's config passes for a pod made
    with this one."""
    ns, ips = pod(), [v4(), v6()]
    prev = _result(host, add(host, host.conf(), ns, ips=ips), ips)
    other = "bridge" if host.routed else "routed"
    host.call(dataplane.check, host.conf(datapath=other), "c1", ns, "eth0", prev)


def test_check_verifies_the_masquerade_rules(host: Host, pod: Callable[[], str]) -> None:
    """Regression (issue 11, CNI 10): CHECK did not look at the ipMasq rules."""
    ns, ips = pod(), [v4(), v6()]
    c = host.conf(ip_masq=True)
    prev = _result(host, add(host, c, ns, ips=ips), ips)
    host.call(dataplane.check, c, "c1", ns, "eth0", prev)
    (v6_rule,) = [r for r in host.nft_rules() if "ip6" in json.dumps(r["expr"])]
    host.sh("ip", "netns", "exec", host.name, "nft", "delete", "rule", "inet", "nodeplug", "postrouting", "handle",
       str(v6_rule["handle"]))  # fmt: skip
    with pytest.raises(CniError, match="ipMasq: no masquerade rule for fd77::5") as e:
        host.call(dataplane.check, c, "c1", ns, "eth0", prev)
    assert e.value.code == 101


def test_gc_removes_stale_veths_and_rules_only(host: Host, pod: Callable[[], str]) -> None:
    c = host.conf(ip_masq=True)
    add(host, c, pod(), cid="keep")
    stale_ns = pod()
    add(host, c, stale_ns, cid="stale", ips=[v4("10.77.0.6/24")])
    add(host, host.conf(name="other", ip_masq=True), pod(), cid="foreign", ips=[v4("10.77.0.7/24")])
    host.sh("ip", "-n", host.name, "link", "add", "vethnotours", "type", "veth", "peer", "name", "vethnotours1")
    host.call(dataplane.gc, c, [("keep", "eth0")])
    assert host.link(names.host_veth_name("stale", "eth0")) is None
    assert [x["ifname"] for x in host.pod_ip(stale_ns, "link", "show")] == ["lo"]
    for cid in ("keep", "foreign"):
        assert host.link(names.host_veth_name(cid, "eth0")) is not None
    assert host.link("vethnotours") is not None
    assert sorted(r["comment"].split()[3] for r in host.nft_rules()) == ["foreign", "keep"]


def test_status_ok_and_touches_nothing(host: Host) -> None:
    """STATUS on a node where ADD can work: success is no error and no output, and nothing made (not even the
    bridge of the config)."""
    assert host.link(BR) is None
    assert host.call(dataplane.status, host.conf(ip_masq=True)) is None
    assert host.link(BR) is None and host.nft_rules() == []


def test_concurrent_adds_on_a_new_bridge(host: Host, pod: Callable[[], str]) -> None:
    pods = [pod() for _ in range(8)]
    c = host.conf(ip_masq=True)

    def one(i: int) -> list[Interface]:
        ip = v4(f"10.77.0.{10 + i}/24")
        if c.routed:
            ip = datapath.with_routed_gateway(ip)
        return dataplane.add(c, f"c{i}", pods[i], "eth0", [ip], default_routes(ip))

    fd = os.open(host.path, os.O_RDONLY)

    def in_host(i: int) -> list[Interface]:
        with entered(fd):
            return one(i)

    try:
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(in_host, range(8)))
    finally:
        os.close(fd)
    assert len({r[-2].name for r in results}) == 8 and len(host.nft_rules()) == 8
    for i in range(8):
        host.ping(pods[i], host.node_addr())
