"""ADD/DEL/CHECK/GC/STATUS through the protocol, the real IPAM store and the real dataplane, on both datapaths.

Every invocation runs on a thread inside a test "host" netns (as the agent's workers run in the node's netns), so the
root netns is never touched; pods are further netns. Delegation uses the reference host-local from /usr/lib/cni.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import cni.dataplane
from cni import commands, skel
from cni.dataplane.netns import entered
from cni.errors import CniError
from cni.ipam import service
from cni.ipam.sqlite import SqliteStore
from cni.netconf import parse_ipam

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates netns, bridges and veth pairs")

REF = "/usr/lib/cni"


class Node:
    """A test netns playing the node; :meth:`cni` runs one CNI invocation on a thread inside it."""

    def __init__(self, name: str, data_dir: Path, sh: Callable[..., str], datapath: str) -> None:
        self.name, self.data_dir = name, data_dir
        self.sh = sh  # support.host.sh: run a set-up command, raise with its stderr
        self.path = f"/run/netns/{name}"
        self.opened: list[SqliteStore] = []
        self.datapath = datapath
        self.routed = datapath == "routed"
        if self.routed:  # an address of the node for its pods to ping (on the bridge datapath: the gateway)
            sh("ip", "-n", name, "addr", "add", "10.87.0.1/32", "dev", "lo")
            sh("ip", "-n", name, "addr", "add", "fd87::1/128", "dev", "lo")

    def node_addr(self, gateway: str) -> str:
        """An address of the node its pods reach: the subnet's ``gateway`` on the bridge datapath."""
        if not self.routed:
            return gateway
        return "fd87::1" if ":" in gateway else "10.87.0.1"

    def pod_addr(self, addr: str) -> str:
        """``addr`` (with its subnet's prefix) as the result gives it: routed, the address alone."""
        ip, _ = addr.split("/")
        return f"{ip}/{128 if ':' in ip else 32}" if self.routed else addr

    def opener(self, data_dir: str, network: str) -> SqliteStore:
        store = SqliteStore(data_dir, network)
        self.opened.append(store)
        return store

    def conf(self, **kw: Any) -> dict[str, Any]:
        base: dict[str, Any] = {
            "cniVersion": "1.1.0",
            "name": "nodenet",
            "type": "nodeplug",
            "bridge": "npc0",
            "datapath": self.datapath,
            "isDefaultGateway": True,
            "ipam": {
                "type": "nodeplug",
                "ranges": [[{"subnet": "10.88.0.0/24"}], [{"subnet": "fd88::/64"}]],
                "dataDir": str(self.data_dir),
            },
        }
        return {**base, **kw}

    def cni(
        self, command: str, conf: dict[str, Any], cid: str = "c1", netns: str = "", ifname: str = "eth0", dp: Any = None
    ) -> tuple[int, Any]:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": cid, "CNI_IFNAME": ifname, "CNI_PATH": REF}
        if netns:
            env["CNI_NETNS"] = netns
        table = commands.table(dp or cni.dataplane, self.opener)

        def inside() -> tuple[int, str]:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                with entered(fd):
                    out = io.StringIO()
                    return skel.run(table, env, json.dumps(conf).encode(), out), out.getvalue()
            finally:
                os.close(fd)

        with ThreadPoolExecutor(1) as ex:
            code, text = ex.submit(inside).result()
        return code, json.loads(text) if text else None

    def leases(self, network: str = "nodenet") -> list[tuple[str, str]]:
        db = self.data_dir / f"{network}.db"
        if not db.exists():
            return []
        store = SqliteStore(self.data_dir, network)
        try:
            with store.transaction() as txn:
                return sorted((x.container_id, x.ip) for x in txn.leases())
        finally:
            store.close()

    def links(self) -> list[str]:
        return [x["ifname"] for x in json.loads(self.sh("ip", "-n", self.name, "-j", "link", "show") or "[]")]

    def ping(self, ns: str, addr: str) -> None:
        self.sh("ip", "netns", "exec", os.path.basename(ns), "ping", "-c", "1", "-W", "2", addr)


@pytest.fixture(params=["bridge", "routed"])
def node(
    request: pytest.FixtureRequest, netns: Callable[[], str], tmp_path: Path, sh: Callable[..., str]
) -> Iterator[Node]:
    n = Node(netns(), tmp_path / "ipam", sh, request.param)
    yield n
    for s in n.opened:
        s.close()


@pytest.fixture
def pod(netns: Callable[[], str]) -> Callable[[], str]:
    return lambda: f"/run/netns/{netns()}"


def test_add_check_del_dual_stack(node: Node, pod: Callable[[], str]) -> None:
    ns = pod()
    code, res = node.cni("ADD", node.conf(), netns=ns)
    assert code == 0, res
    assert [ip["address"] for ip in res["ips"]] == [node.pod_addr("10.88.0.2/24"), node.pod_addr("fd88::2/64")]
    assert res["interfaces"][-1]["sandbox"] == ns and {ip["interface"] for ip in res["ips"]} == {
        len(res["interfaces"]) - 1
    }
    assert [i["name"] for i in res["interfaces"][:-2]] == ([] if node.routed else ["npc0"])
    assert {"dst": "0.0.0.0/0", "gw": "169.254.1.1" if node.routed else "10.88.0.1"} in res["routes"]
    node.ping(ns, node.node_addr("10.88.0.1"))
    node.ping(ns, node.node_addr("fd88::1"))
    assert node.cni("CHECK", node.conf(prevResult=res), netns=ns) == (0, None)
    assert node.cni("DEL", node.conf(prevResult=res), netns=ns) == (0, None)
    assert node.leases() == []
    assert node.cni("DEL", node.conf(), netns=ns) == (0, None)  # idempotent


def test_repeat_add_same_container_keeps_its_address(node: Node, pod: Callable[[], str]) -> None:
    ns = pod()
    code, first = node.cni("ADD", node.conf(), netns=ns)
    assert code == 0
    node.cni("DEL", node.conf(), netns=ns)
    code, _ = node.cni("ADD", node.conf(), netns=ns, cid="other")
    assert code == 0
    ns2 = pod()
    code, second = node.cni("ADD", node.conf(), netns=ns2, cid="c1")
    assert code == 0 and second["ips"][0]["address"] != first["ips"][0]["address"]  # continues, does not reuse at once


def test_del_without_netns_frees_the_lease_and_the_host_veth(node: Node, pod: Callable[[], str]) -> None:
    ns = pod()
    code, res = node.cni("ADD", node.conf(), netns=ns)
    assert code == 0
    host_veth = res["interfaces"][-2]["name"]
    node.sh("ip", "netns", "delete", os.path.basename(ns))  # the runtime lost the sandbox
    assert node.cni("DEL", node.conf(), netns="") == (0, None)
    assert node.leases() == []
    assert host_veth not in node.links()


def test_failed_add_leaves_no_lease_no_veth(node: Node, pod: Callable[[], str]) -> None:
    ns = pod()
    node.sh(
        "ip", "-n", os.path.basename(ns), "link", "add", "eth0", "type", "veth", "peer", "name", "taken0"
    )  # the ifname is taken in the pod
    before = set(node.links())
    code, err = node.cni("ADD", node.conf(), netns=ns)
    assert code == 1 and err["code"] >= 100 and "eth0" in err["details"]
    assert node.leases() == []
    assert not [x for x in set(node.links()) - before if x.startswith("veth")]


def test_failed_add_after_ipam_releases_when_the_dataplane_raises(node: Node, pod: Callable[[], str]) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            return getattr(cni.dataplane, name)

        def add(self, *a: Any) -> Any:
            raise CniError(101, details="injected failure")

    code, err = node.cni("ADD", node.conf(), netns=pod(), dp=Broken())
    assert code == 1 and err["details"] == "injected failure"
    assert node.leases() == []


def test_gc_releases_stale_leases_and_veths(node: Node, pod: Callable[[], str]) -> None:
    results = {}
    for cid in ("keep", "stale1", "stale2"):
        code, results[cid] = node.cni("ADD", node.conf(), cid=cid, netns=pod())
        assert code == 0
    gc_conf = node.conf(**{"cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "eth0"}]})
    assert node.cni("GC", gc_conf) == (0, None)
    assert [cid for cid, _ in node.leases()] == ["keep", "keep"]
    links = node.links()
    assert results["keep"]["interfaces"][-2]["name"] in links
    assert results["stale1"]["interfaces"][-2]["name"] not in links
    assert results["stale2"]["interfaces"][-2]["name"] not in links


def test_status(node: Node) -> None:
    small = node.conf(
        ipam={"type": "nodeplug", "ranges": [[{"subnet": "10.89.0.0/30"}]], "dataDir": str(node.data_dir)}
    )
    assert node.cni("STATUS", small) == (0, None)
    ipam = parse_ipam(small["ipam"])
    service.add("nodenet", ipam, "x", "eth0", opener=node.opener)  # the /30 has one address besides the gateway
    code, err = node.cni("STATUS", small)
    assert code == 1 and err["code"] == 50


def test_delegation_to_host_local(node: Node, pod: Callable[[], str]) -> None:
    hl_dir = node.data_dir / "host-local"
    conf = node.conf(
        isDefaultGateway=False,
        isGateway=True,
        ipam={"type": "host-local", "ranges": [[{"subnet": "10.90.0.0/24"}]], "dataDir": str(hl_dir)},
    )
    conf["cniVersion"] = "1.0.0"  # the reference plugins speak up to 1.0.0
    ns = pod()
    code, res = node.cni("ADD", conf, netns=ns)
    assert code == 0, res
    gateway, pod = ("169.254.1.1", 1) if node.routed else ("10.90.0.1", 2)
    assert res["ips"] == [{"address": node.pod_addr("10.90.0.2/24"), "gateway": gateway, "interface": pod}]
    assert (hl_dir / "nodenet" / "10.90.0.2").read_text().startswith("c1")
    if node.routed:  # no default route: the pod reaches its subnet through the node (here, an address of the node)
        assert res["routes"] == [{"dst": "10.90.0.0/24", "gw": "169.254.1.1"}]
        node.sh("ip", "-n", node.name, "addr", "add", "10.90.0.1/32", "dev", "lo")
    node.ping(ns, "10.90.0.1")
    assert node.cni("CHECK", {**conf, "prevResult": res}, netns=ns) == (0, None)
    assert node.cni("DEL", {**conf, "prevResult": res}, netns=ns) == (0, None)
    assert not (hl_dir / "nodenet" / "10.90.0.2").exists()


def test_delegated_ipam_errors_pass_through_and_unknown_plugin_is_named(node: Node, pod: Callable[[], str]) -> None:
    conf = node.conf(ipam={"type": "host-local"})  # host-local without ranges
    conf["cniVersion"] = "1.0.0"
    code, err = node.cni("ADD", conf, netns=pod())
    assert code == 1 and err["msg"] == "no IP ranges specified"  # host-local's own error, unchanged
    code, err = node.cni("ADD", node.conf(ipam={"type": "no-such-ipam"}), netns=pod())
    assert code == 1 and err["code"] == 7 and "no-such-ipam" in err["details"]


def test_failed_add_with_delegated_ipam_releases_its_address(node: Node, pod: Callable[[], str]) -> None:
    hl_dir = node.data_dir / "host-local"
    conf = node.conf(ipam={"type": "host-local", "subnet": "10.91.0.0/24", "dataDir": str(hl_dir)})
    conf["cniVersion"] = "1.0.0"
    ns = pod()
    node.sh("ip", "-n", os.path.basename(ns), "link", "add", "eth0", "type", "veth", "peer", "name", "taken0")
    code, _ = node.cni("ADD", conf, netns=ns)
    assert code == 1
    assert not (hl_dir / "nodenet" / "10.91.0.2").exists()
