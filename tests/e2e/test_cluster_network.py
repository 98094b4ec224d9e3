"""The cluster pod network on several nodes against a real kube-apiserver + etcd (scripts/lab/clusterlab.py).

Five nodes, each a network namespace with its own agent: node-1..3 on one L2 segment, node-4 behind a router on
another subnet (so ``auto`` mode routes 1..3 among themselves directly and to and from node-4 over VXLAN), node-5 on
the segment but registered without a podCIDR. Two pods on each of node-1..4, ADDed through the node's CNI entry point:
one on the bridge datapath, one on the routed datapath (connectivity and masquerade are tested on each). Runs in one
module-scoped lab (about a minute to build); every test leaves the lab as it found it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cni.cluster import offload

from lab.clusterlab import OUTSIDE, Lab, Netns, Node, Pod, missing_assets, wait_for
from support.serving import Serving

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok")]

PORT = 7000
HANG = 60  # bounds a hang: five agents and an API server share two cores with whatever else runs here


class WhoAmI:
    """A TCP server in a netns answering every connection with the peer address it sees (source kept or not)."""

    def __init__(self, ns: Netns) -> None:
        self.ns = ns
        self.serving = Serving()
        for family in (socket.AF_INET, socket.AF_INET6):
            self.serving.serve(ns.call(self._listen, family), self._serve)

    @staticmethod
    def _listen(family: int) -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", PORT))
        s.listen(64)
        return s

    @staticmethod
    def _serve(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, peer = s.accept()
                with conn:
                    conn.sendall(peer[0].encode())

    def close(self) -> None:
        self.serving.close()


def seen_by(src: Netns, dst: str) -> str:
    """Connect from ``src`` to a WhoAmI server at ``dst``: the source address it saw."""

    def go() -> str:
        with socket.create_connection((dst, PORT), timeout=3) as c:
            return c.recv(100).decode()

    return str(src.call(go))


def pings(src: Netns, dst: str, tries: int = 3) -> bool:
    """One echo reply from ``dst`` (a few tries: the first packet may wait for neighbour discovery)."""
    return any(" 0% packet loss" in src.exec("ping", "-n", "-c1", "-W1", dst, check=False) for _ in range(tries))


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = Path(tmp_path_factory.mktemp("cluster"))
    with Lab(work, l2_nodes=3, routed=True, extra_l2=1) as lab:
        for node in lab.nodes:
            lab.register(node, with_cidr=node.index != 5)
        for node in lab.nodes:
            node.start()
        for node in lab.nodes[:4]:
            node.wait_ready()
        for datapath in ("bridge", "routed"):
            for node in lab.nodes[:4]:
                lab.add_pod(node, datapath)
        servers = [WhoAmI(p.ns) for p in lab.pods] + [WhoAmI(next(n for n in lab.netns if n.name.endswith("-out")))]
        try:
            yield lab
        finally:
            for s in servers:
                s.close()
            for node in lab.nodes:  # on failure, the agents' logs say why
                print(f"----- {node.name} agent log (tail)\n{node.log_tail(3000)}")


def pods(lab: Lab, datapath: str = "bridge") -> list[Pod]:
    """The pod of each of the first four nodes on ``datapath``."""
    return [p for p in lab.pods[:8] if p.datapath == datapath]


def all_pairs_connected(lab: Lab, datapath: str = "bridge") -> list[str]:
    """Every ordered pod pair of ``datapath``, both families: ICMP and TCP; the source address arrives unchanged."""
    failures = []
    for a in pods(lab, datapath):
        for b in pods(lab, datapath):
            if a is b:
                continue
            for src, dst in ((a.ip4, b.ip4), (a.ip6, b.ip6)):
                if not pings(a.ns, dst):
                    failures.append(f"ping {a.node.name} {src} -> {b.node.name} {dst}")
                    continue
                try:
                    seen = seen_by(a.ns, dst)
                except OSError as e:
                    failures.append(f"tcp {a.node.name} -> {b.node.name} {dst}: {e}")
                    continue
                if seen != src:
                    failures.append(f"tcp {a.node.name} -> {b.node.name} {dst}: source {src} arrived as {seen}")
    return failures


def routes(node: Node, version: int = 4) -> dict[str, dict[str, Any]]:
    out = node.ns.ip("-j", f"-{version}", "route", "show", "proto", "110")
    return {r["dst"]: r for r in json.loads(out or "[]")}


def fdb(node: Node) -> dict[str, str]:
    out = node.ns.exec("bridge", "-j", "fdb", "show", "dev", "nodeplug.vx", check=False)
    return {e["mac"]: e.get("dst", "") for e in json.loads(out or "[]") if e.get("dst")}


def neigh(node: Node) -> dict[str, str]:
    out = node.ns.ip("-j", "neigh", "show", "dev", "nodeplug.vx", check=False)
    out6 = node.ns.ip("-j", "-6", "neigh", "show", "dev", "nodeplug.vx", check=False)
    return {e["dst"]: e.get("lladdr", "") for e in json.loads(out or "[]") + json.loads(out6 or "[]")}


# ---------------------------------------------------------------- connectivity and paths


@pytest.mark.parametrize("datapath", ["bridge", "routed"])
def test_every_pod_reaches_every_pod_on_every_node_in_both_families_with_its_source_kept(
    lab: Lab, datapath: str
) -> None:
    assert all_pairs_connected(lab, datapath) == []


def test_pods_of_either_datapath_reach_each_other_across_nodes(lab: Lab) -> None:
    """A node moving to the routed datapath keeps its bridged pods: they and the routed pods of other nodes talk."""
    bridged, routed = pods(lab, "bridge"), pods(lab, "routed")
    for a, b in [(bridged[0], routed[1]), (routed[1], bridged[0]), (routed[3], bridged[2]), (bridged[2], routed[3])]:
        assert pings(a.ns, b.ip4) and pings(a.ns, b.ip6), (a.node.name, a.datapath, b.node.name, b.datapath)
        assert seen_by(a.ns, b.ip4) == a.ip4


def test_auto_mode_routes_the_segment_directly_and_the_routed_node_over_vxlan(lab: Lab) -> None:
    n1, n2, n4 = lab.nodes[0], lab.nodes[1], lab.nodes[3]
    r4, r6 = routes(n1, 4), routes(n1, 6)
    assert r4["10.244.2.0/24"]["gateway"] == n2.ip4 and r4["10.244.2.0/24"]["dev"] == "eth0"
    assert r6["fd44:0:0:2::/64"]["gateway"] == n2.ip6
    assert r4["10.244.4.0/24"] == {**r4["10.244.4.0/24"], "gateway": "10.244.4.0", "dev": "nodeplug.vx"}
    assert "onlink" in r4["10.244.4.0/24"]["flags"] and r6["fd44:0:0:4::/64"]["dev"] == "nodeplug.vx"
    node4 = lab.api.ok("GET", f"/api/v1/nodes/{n4.name}")["metadata"]["annotations"]
    mac = node4["nodeplug.io/vtep-mac"]
    assert node4["nodeplug.io/vtep-address"] == n4.ip4
    assert fdb(n1) == {mac: n4.ip4}
    assert neigh(n1) == {"10.244.4.0": mac, "fd44:0:0:4::": mac}
    # node-4 reaches all three over VXLAN; node-5 (no podCIDR yet) is nobody's route
    assert {d for d, r in routes(n4, 4).items() if r["dev"] == "nodeplug.vx"} == {f"10.244.{i}.0/24" for i in (1, 2, 3)}
    # the pod MTU leaves room for the VXLAN headers (underlay 1500)
    for pod in (pods(lab, "bridge")[0], pods(lab, "routed")[0]):
        assert json.loads(pod.ns.ip("-j", "link", "show", "eth0"))[0]["mtu"] == 1450
    assert json.loads(n1.ns.ip("-j", "link", "show", "nodeplug.vx"))[0]["mtu"] == 1450


def test_doctor_checks_every_peer_is_routed_as_the_mode_says(lab: Lab) -> None:
    n1 = lab.nodes[0]
    line = n1.doctor("peer pod subnets")
    assert " OK " in line and "direct 4" in line and "vxlan 2" in line, line
    # a route of ours taken over behind the agent's back (it leaves routes it does not own alone): the doctor says which
    n1.ns.ip("route", "replace", "10.244.2.0/24", "via", lab.nodes[1].ip4, "proto", "static")
    try:
        line = n1.doctor("peer pod subnets")
        assert " FAIL " in line and "node-2" in line and "10.244.2.0/24" in line, line
    finally:
        n1.ns.ip("route", "replace", "10.244.2.0/24", "via", lab.nodes[1].ip4, "proto", "110")


def full_passes(node: Node) -> float:
    line = next((x for x in node.http("/metrics")[1].splitlines()
                 if x.startswith('nodeplug_cluster_reconcile_seconds_count{kind="full"}')), "")  # fmt: skip
    return float(line.split()[-1]) if line else 0.0


def test_what_undoes_the_network_behind_the_agents_back_is_repaired_without_waiting_for_the_resync(lab: Lab) -> None:
    """A route of ours deleted by hand, an FDB entry removed, the underlay going down and up (the kernel drops every
    IPv4 route through it and tells nobody): each is back although the next resync is an hour away."""
    n1, n2, n4 = lab.nodes[0], lab.nodes[1], lab.nodes[3]
    started = n1.log_tail(10**9).count("following Node objects")
    lab_routes: list[tuple[int, str]] = []  # the node's default routes, which the flap below takes away

    def restore_lab_routes() -> None:
        for v, line in lab_routes:
            n1.ns.ip(f"-{v}", "route", "replace", *line.split())

    try:
        n1.write_config(resync=3600)  # a changed section restarts the service: an hour to its next resync
        wait_for("the service restarted", lambda: n1.log_tail(10**9).count("following Node objects") > started,
                 timeout=HANG)  # fmt: skip
        passes = full_passes(n1)
        wait_for("its first full pass", lambda: full_passes(n1) > passes, timeout=HANG)
        want4, want6, want_fdb = routes(n1, 4), routes(n1, 6), fdb(n1)
        assert n2.pod4 in want4 and n4.pod4 in want4 and want_fdb

        n1.ns.ip("route", "del", n2.pod4, "proto", "110")
        n1.ns.ip("-6", "route", "del", n2.pod6, "proto", "110")
        wait_for("the deleted routes back", lambda: routes(n1, 4) == want4 and routes(n1, 6) == want6, timeout=HANG)

        mac, dst = next(iter(want_fdb.items()))
        n1.ns.exec("bridge", "fdb", "del", mac, "dev", "nodeplug.vx", "dst", dst)
        wait_for("the FDB entry back", lambda: fdb(n1) == want_fdb, timeout=HANG)

        # IPv6 addresses are kept over the flap (by default the kernel drops them with the link, and with them this
        # node's IPv6 InternalIP: its agent would then rightly route the peers' IPv6 subnets another way)
        n1.ns.exec("sysctl", "-qw", "net.ipv6.conf.eth0.keep_addr_on_down=1")
        lab_routes += [(v, line) for v in (4, 6) for line in n1.ns.ip(f"-{v}", "route", "show", "default").splitlines()]
        n1.ns.ip("link", "set", "eth0", "down")
        wait_for("the kernel dropped the routes through eth0", lambda: n2.pod4 not in routes(n1, 4), timeout=HANG)
        n1.ns.ip("link", "set", "eth0", "up")
        restore_lab_routes()  # the node's own way out, the lab's (its network manager would put it back)
        wait_for("every route back after the underlay came up",
                 lambda: routes(n1, 4) == want4 and routes(n1, 6) == want6 and fdb(n1) == want_fdb,
                 timeout=HANG)  # fmt: skip
        assert all_pairs_connected(lab, "routed") == []
    finally:
        n1.ns.ip("link", "set", "eth0", "up")
        restore_lab_routes()  # also when the test failed with the link down: the lab is left as it was
        n1.ns.exec("sysctl", "-qw", "net.ipv6.conf.eth0.keep_addr_on_down=0")
        n1.write_config()
        wait_for("back to the usual resync", lambda: n1.log_tail(10**9).count("following Node objects") > started + 1,
                 timeout=HANG)  # fmt: skip
        n1.wait_ready()


@pytest.mark.parametrize("datapath", ["bridge", "routed"])
def test_pod_traffic_leaving_the_cluster_is_masqueraded(lab: Lab, datapath: str) -> None:
    out_ns = next(n for n in lab.netns if n.name.endswith("-out"))
    for pod in pods(lab, datapath):
        assert seen_by(pod.ns, OUTSIDE) == pod.node.ip4
        assert seen_by(pod.ns, "fd99::10") == pod.node.ip6
    assert out_ns is not None


def tx_checksum(node: Node) -> str:
    out = node.ns.exec("ethtool", "-k", "nodeplug.vx")
    return next(line.split(":")[1].split()[0] for line in out.splitlines() if "tx-checksum-ip-generic" in line)


@pytest.mark.skipif(not shutil.which("ethtool"), reason="needs ethtool (Debian package ethtool; scripts/setup)")
def test_the_vxlan_checksum_offload_follows_the_config(lab: Lab) -> None:
    """``auto`` (the default) leaves it on from kernel 5.7 (cni.cluster.offload); ``false`` turns it off, through a
    config reload, and VXLAN traffic flows either way."""
    n1, n4 = lab.nodes[0], lab.nodes[3]
    assert tx_checksum(n1) == ("on" if offload.wanted("auto") else "off")
    try:
        for node in (n1, n4):
            node.write_config("auto", "  vxlan: {tx_checksum_offload: false}\n")
        wait_for("offload off", lambda: tx_checksum(n1) == tx_checksum(n4) == "off", timeout=HANG)
        p1, p4 = pods(lab, "routed")[0], pods(lab, "routed")[3]
        assert seen_by(p1.ns, p4.ip4) == p1.ip4 and seen_by(p4.ns, p1.ip6) == p4.ip6
    finally:
        for node in (n1, n4):
            node.write_config("auto")
    wait_for("offload as auto says", lambda: tx_checksum(n1) == ("on" if offload.wanted("auto") else "off"), HANG)


# ---------------------------------------------------------------- a node without a podCIDR


def test_a_node_without_podcidr_is_not_ready_and_add_says_why_until_it_gets_one(lab: Lab) -> None:
    n5 = lab.nodes[4]
    _, body = wait_for("node-5 readiness", lambda: (s := n5.http("/readyz"))[0] == 503 and s)
    assert "node-5 has no spec.podCIDRs" in body and "--allocate-node-cidrs" in body
    ns = Netns(f"{lab.tag}-nocidr")
    lab.netns.append(ns)
    code, err = n5.cni("ADD", ns.name, f"{lab.tag}-nocidr")
    assert code == 1 and err["code"] == 11 and "node-5 has no pod subnet" in err["details"], err
    assert not n5.ns.ip("-j", "addr", "show", "dev", "nodeplug0", check=False).strip()  # nothing made on the host
    lab.api.ok("PATCH", "/api/v1/nodes/node-5", {"spec": {"podCIDRs": [n5.pod4, n5.pod6], "podCIDR": n5.pod4}},
               "application/merge-patch+json")  # fmt: skip
    n5.wait_ready(HANG)
    pod5 = lab.add_pod(n5)
    try:
        assert pod5.ip4.startswith("10.244.5.") and pod5.ip6.startswith("fd44:0:0:5::")
        wait_for("node-1 routes node-5's subnet", lambda: "10.244.5.0/24" in routes(lab.nodes[0]), timeout=HANG)
        assert pings(lab.pods[0].ns, pod5.ip4) and pings(pod5.ns, lab.pods[3].ip6)
    finally:
        n5.cni("DEL", pod5.ns.name, pod5.cid)


# ---------------------------------------------------------------- following Node objects


def test_node_added_changed_and_deleted_converge(lab: Lab) -> None:
    """Each change of a Node object reaches the kernel (how fast is scripts/bench-cluster-network's business)."""
    n1 = lab.nodes[0]
    vtep = {"nodeplug.io/vtep-mac": "02:00:00:00:00:61", "nodeplug.io/vtep-address": "192.168.78.61"}
    lab.api.node("fake-direct", ["10.244.60.0/24"], ["192.168.77.60"])
    lab.api.node("fake-vxlan", ["10.244.61.0/24", "fd44:0:0:61::/64"], ["192.168.78.61"], vtep)
    wait_for("routes to both", lambda: {"10.244.60.0/24", "10.244.61.0/24"} <= set(routes(n1)), timeout=HANG)
    wait_for("fdb and neighbours", lambda: fdb(n1).get("02:00:00:00:00:61") == "192.168.78.61"
             and neigh(n1).get("fd44:0:0:61::") == "02:00:00:00:00:61", timeout=HANG)  # fmt: skip
    assert routes(n1)["10.244.60.0/24"]["gateway"] == "192.168.77.60"
    # changed: the peer's VTEP moves (a new MAC and underlay address)
    patch = {"metadata": {"annotations": {"nodeplug.io/vtep-mac": "02:00:00:00:00:62",
                                          "nodeplug.io/vtep-address": "192.168.78.62"}}}  # fmt: skip
    lab.api.ok("PATCH", "/api/v1/nodes/fake-vxlan", patch, "application/merge-patch+json")
    wait_for("the new VTEP", lambda: fdb(n1).get("02:00:00:00:00:62") == "192.168.78.62"
             and "02:00:00:00:00:61" not in fdb(n1) and neigh(n1).get("10.244.61.0") == "02:00:00:00:00:62",
             timeout=HANG)  # fmt: skip
    lab.api.ok("DELETE", "/api/v1/nodes/fake-direct")
    lab.api.ok("DELETE", "/api/v1/nodes/fake-vxlan")
    wait_for("all of it gone", lambda: not {"10.244.60.0/24", "10.244.61.0/24"} & set(routes(n1))
             and "02:00:00:00:00:62" not in fdb(n1) and "10.244.61.0" not in neigh(n1)
             and "fd44:0:0:61::/64" not in routes(n1, 6), timeout=HANG)  # fmt: skip


# ---------------------------------------------------------------- restarts and outages


def _ping_flood(src: Netns, dst: str) -> subprocess.Popen[str]:
    """Pings every 10 ms until :func:`_lost` stops it (at most :data:`HANG` seconds), a line per reply."""
    return subprocess.Popen(
        ["ip", "netns", "exec", src.name, "ping", "-n", "-i", "0.01", "-w", str(HANG), "-W", "1", dst],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _lost(proc: subprocess.Popen[str]) -> tuple[int, list[int]]:
    """Stop a flood (SIGINT: ping prints its summary) and return (echo requests sent, those never answered); the
    one still in flight when it was stopped is not lost."""
    assert proc.poll() is None, "the flood ended before the restart was over"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    m = re.search(r"(\d+) packets transmitted", out)
    assert m, out
    sent = int(m.group(1))
    answered = {int(seq) for seq in re.findall(r"icmp_seq=(\d+) ", out)}
    return sent, [seq for seq in range(1, sent) if seq not in answered]


def test_agent_kill9_and_restart_loses_no_packet_and_removes_only_stale_entries(lab: Lab) -> None:
    n1, n4 = lab.nodes[0], lab.nodes[3]
    p1, p2, p4 = lab.pods[0], lab.pods[1], lab.pods[3]
    mac_before = json.loads(n1.ns.ip("-j", "link", "show", "nodeplug.vx"))[0]["address"]
    vx_index = json.loads(n1.ns.ip("-j", "link", "show", "nodeplug.vx"))[0]["ifindex"]
    floods = [_ping_flood(p1.ns, p4.ip4), _ping_flood(p1.ns, p2.ip6), _ping_flood(p4.ns, p1.ip6)]
    time.sleep(1)  # traffic flowing before the kill
    for node in (n1, n4):
        node.kill(signal.SIGKILL)
    # stale entries of "an earlier run" (a peer that left while the agent was down), and one that is not ours
    n1.ns.ip("route", "add", "10.244.99.0/24", "via", "192.168.77.99", "proto", "110")
    n1.ns.ip("route", "add", "10.244.98.0/24", "via", "192.168.77.98", "proto", "static")
    n1.ns.exec("bridge", "fdb", "add", "02:00:00:00:00:99", "dev", "nodeplug.vx", "dst", "192.168.78.99")
    n1.ns.ip("neigh", "add", "10.244.99.0", "lladdr", "02:00:00:00:00:99", "dev", "nodeplug.vx", "nud", "permanent")
    time.sleep(1)
    for node in (n1, n4):
        node.start()
    for node in (n1, n4):
        node.wait_ready(HANG)
    wait_for("stale entries removed", lambda: "10.244.99.0/24" not in routes(n1) and "02:00:00:00:00:99" not in fdb(n1)
             and "10.244.99.0" not in neigh(n1), timeout=HANG)  # fmt: skip
    time.sleep(1)  # and after the restart
    results = [_lost(p) for p in floods]
    assert all(not lost for _, lost in results), f"(sent, sequence numbers lost) per flow: {results}"
    link = json.loads(n1.ns.ip("-j", "link", "show", "nodeplug.vx"))[0]
    assert (link["address"], link["ifindex"]) == (mac_before, vx_index)  # the very same device
    assert "10.244.98.0/24" in n1.ns.ip("route", "show", "proto", "static")  # not ours: left alone
    n1.ns.ip("route", "del", "10.244.98.0/24")


@pytest.mark.parametrize("mode", ["vxlan", "direct"])
def test_other_modes_after_a_config_reload(lab: Lab, mode: str) -> None:
    segment = lab.nodes[:3]
    try:
        for node in lab.nodes[:4]:
            node.write_config(mode)  # picked up within a second (the agent compares the file's content)
        if mode == "vxlan":
            wait_for("every route over VXLAN", lambda: all(
                len(routes(n)) == 4 and all(r["dev"] == "nodeplug.vx" for r in routes(n).values())
                for n in lab.nodes[:4]), timeout=HANG)  # fmt: skip
            assert all_pairs_connected(lab) == []
        else:
            wait_for("direct routes only, no VXLAN device", lambda: all(
                {f"10.244.{m.index}.0/24" for m in segment if m is not n} <= set(routes(n))
                and "10.244.4.0/24" not in routes(n) and all(r["dev"] == "eth0" for r in routes(n).values())
                and not n.ns.ip("link", "show", "nodeplug.vx", check=False) for n in segment),
                timeout=HANG)  # fmt: skip
            for a in lab.pods[:3]:
                for b in lab.pods[:3]:
                    if a is not b:
                        assert pings(a.ns, b.ip4) and pings(a.ns, b.ip6) and seen_by(a.ns, b.ip4) == a.ip4
            _, body = lab.nodes[0].http("/readyz")
            assert "unrouted 2" in body  # node-4: not on the segment, and direct mode has no other way
    finally:
        for node in lab.nodes[:4]:
            node.write_config("auto")
        wait_for("back to auto", lambda: all(len(routes(n)) == 4 for n in lab.nodes[:4]), timeout=HANG)
    assert all_pairs_connected(lab) == []


def doctor_line(node: Node) -> str:
    return node.doctor("peer pod subnets")


def on_path(node: Node, mode: str, lab: Lab) -> bool:
    """Every peer subnet of both families is routed the way ``mode`` says, on ``node``."""
    got = {**routes(node, 4), **routes(node, 6)}
    peers = [n for n in lab.nodes[:4] if n is not node]
    segment = lambda n: n.ip4.startswith("192.168.77.")  # noqa: E731
    for peer in peers:
        for dst in (peer.pod4, peer.pod6):
            r = got.get(dst)
            vxlan = mode == "vxlan" or (mode == "auto" and not (segment(peer) and segment(node)))
            if mode == "direct" and not (segment(peer) and segment(node)):
                if r is not None:
                    return False
                continue
            if r is None or (r["dev"] == "nodeplug.vx") != vxlan:
                return False
    return True


def test_a_mode_change_rolled_node_by_node_lands_every_route_in_both_families(lab: Lab) -> None:
    """direct -> vxlan -> direct -> auto, one node at a time, as a DaemonSet rolls: each node ends with every peer's
    IPv4 and IPv6 subnet on the new path (IPv6 moving between the underlay and VXLAN needs the delete + add the
    kernel allows, not the replace it refuses), nothing is counted as failed, and the doctor agrees."""
    try:
        for mode in ("direct", "vxlan", "direct", "auto"):
            for node in lab.nodes[:4]:
                node.write_config(mode)
                wait_for(f"{node.name} on {mode} paths", lambda n=node, m=mode: on_path(n, m, lab), timeout=30)
            for node in lab.nodes[:4]:
                wait_for(f"{node.name} still on {mode} paths", lambda n=node, m=mode: on_path(n, m, lab), timeout=30)
                line = doctor_line(node)  # direct mode cannot route node-4 (off the segment): the doctor says so
                assert (" OK " in line) == (mode != "direct"), line
            reachable = pods(lab) if mode != "direct" else pods(lab)[:3]
            for a in reachable:
                for b in reachable:
                    if a is not b:
                        assert pings(a.ns, b.ip4) and pings(a.ns, b.ip6), (mode, a.node.name, b.node.name)
        for node in lab.nodes[:4]:
            assert 'nodeplug_cluster_kernel_changes_total{outcome="failed"} 0.0' in node.http("/metrics")[1]
    finally:
        for node in lab.nodes[:4]:
            node.write_config("auto")
        wait_for("back to auto", lambda: all(on_path(n, "auto", lab) for n in lab.nodes[:4]), timeout=30)


def failed_changes(node: Node) -> str:
    return next(x for x in node.http("/metrics")[1].splitlines() if 'kernel_changes_total{outcome="failed"}' in x)


def test_auto_mode_follows_a_peer_moving_between_segments_in_both_families(lab: Lab) -> None:
    """A peer (a Node object only: no traffic needs to reach it) whose InternalIPs move from node-1's segment to the
    routed one and back, its VTEP address with them: node-1 moves both of its subnets from the direct path to VXLAN
    and back (IPv6 included, where the kernel refuses a replace across the two), counting nothing as failed."""
    n1 = lab.nodes[0]
    before = failed_changes(n1)

    def at(ip4: str, ip6: str) -> None:
        lab.api.ok("PATCH", "/api/v1/nodes/mover", {"metadata": {"annotations": {"nodeplug.io/vtep-address": ip4}}},
                   "application/merge-patch+json")  # fmt: skip
        status = {"status": {"addresses": [{"type": "InternalIP", "address": a} for a in (ip4, ip6)]}}
        lab.api.ok("PATCH", "/api/v1/nodes/mover/status", status, "application/merge-patch+json")

    def paths() -> tuple[str, str]:
        r4, r6 = routes(n1, 4).get("10.244.60.0/24"), routes(n1, 6).get("fd44:0:0:60::/64")
        return (r4 or {}).get("dev", ""), (r6 or {}).get("dev", "")

    vtep = {"nodeplug.io/vtep-mac": "02:00:00:00:3c:01", "nodeplug.io/vtep-address": "192.168.77.60"}
    lab.api.node("mover", ["10.244.60.0/24", "fd44:0:0:60::/64"], ["192.168.77.60", "fd77::60"], vtep)
    try:
        wait_for("mover routed directly", lambda: paths() == ("eth0", "eth0"), timeout=HANG)
        assert routes(n1, 6)["fd44:0:0:60::/64"]["gateway"] == "fd77::60"
        at("192.168.78.60", "fd78::60")
        wait_for("mover over VXLAN in both families", lambda: paths() == ("nodeplug.vx",) * 2, timeout=HANG)
        assert fdb(n1)["02:00:00:00:3c:01"] == "192.168.78.60"
        at("192.168.77.60", "fd77::60")
        wait_for("mover routed directly again", lambda: paths() == ("eth0", "eth0"), timeout=HANG)
        assert "02:00:00:00:3c:01" not in fdb(n1)
        assert failed_changes(n1) == before
    finally:
        lab.api.ok("DELETE", "/api/v1/nodes/mover")
    wait_for("mover's routes gone", lambda: paths() == ("", ""), timeout=HANG)


def test_a_route_the_kernel_refuses_is_counted_failed_named_in_readyz_and_an_event_until_it_lands(lab: Lab) -> None:
    """IPv6 switched off on node-1's VXLAN device (an operator's sysctl): the kernel refuses any IPv6 route through
    it, whatever the fallback. The refused route is counted as failed (not done), /readyz names the peer and the
    family, and an Event says so on node-1; once IPv6 is back, the next pass lands it."""
    n1 = lab.nodes[0]
    sysctl = "net.ipv6.conf.nodeplug/vx.disable_ipv6"

    def failed() -> float:
        return float(failed_changes(n1).rsplit(" ", 1)[1])

    before = failed()
    landed6 = set(routes(n1, 6))  # the peers' IPv6 routes over the device: the kernel flushes them with its IPv6
    assert any(r.get("dev") == "nodeplug.vx" for r in routes(n1, 6).values())
    vtep = {"nodeplug.io/vtep-mac": "02:00:00:00:3d:01", "nodeplug.io/vtep-address": "192.168.78.61"}
    n1.ns.exec("sysctl", "-qw", f"{sysctl}=1")
    try:
        lab.api.node("refused6", ["10.244.61.0/24", "fd44:0:0:61::/64"], ["192.168.78.61", "fd78::61"], vtep)
        wait_for("the IPv6 route counted as failed and named in /readyz", lambda: failed() > before and (
            "refused6 IPv6" in n1.http("/readyz")[1]), timeout=HANG)  # fmt: skip
        assert "10.244.61.0/24" in routes(n1, 4) and "fd44:0:0:61::/64" not in routes(n1, 6)
        assert n1.http("/readyz")[0] == 503

        def notes() -> list[str]:
            return [str(e.get("note")) for e in lab.api.ok(
                "GET", f"/apis/events.k8s.io/v1/namespaces/default/events?fieldSelector=regarding.name%3D{n1.name}"
            )["items"] if e.get("reason") == "RouteNotProgrammed"]  # fmt: skip

        # the Event is posted by the agent's recorder after the pass that found it, not with /readyz's answer
        wait_for("an Event naming the refused route", lambda: any("refused6 IPv6" in n for n in notes()), timeout=HANG)
        n1.ns.exec("sysctl", "-qw", f"{sysctl}=0")
        wait_for("the route lands once the kernel takes it", lambda: "fd44:0:0:61::/64" in routes(n1, 6), timeout=HANG)
        wait_for("ready again", lambda: n1.http("/readyz")[0] == 200, timeout=HANG)
        # ready means every planned route is in place, those the kernel flushed with the device's IPv6 included
        assert landed6 <= set(routes(n1, 6)), landed6 - set(routes(n1, 6))
    finally:
        n1.ns.exec("sysctl", "-qw", f"{sysctl}=0", check=False)
        lab.api.ok("DELETE", "/api/v1/nodes/refused6")
    wait_for("refused6's routes gone", lambda: "10.244.61.0/24" not in routes(n1, 4), timeout=HANG)


def test_api_server_away_keeps_the_network_and_the_agent_catches_up(lab: Lab) -> None:
    assert lab.cp is not None
    n1 = lab.nodes[0]
    lab.cp.stop("apiserver")
    try:
        flood = _ping_flood(lab.pods[0].ns, lab.pods[3].ip4)
        wait_for("the agent notices", lambda: "API server unreachable" in n1.http("/readyz")[1], timeout=HANG)
        status, body = n1.http("/readyz")
        assert status == 503 and "routes kept" in body  # honest: not ready; the network stays as it was
        time.sleep(1)  # traffic flowing while the agent knows the API server is away
        assert _lost(flood)[1] == []
        assert all_pairs_connected(lab) == []
        # meanwhile, through a second API server on the same etcd, a Node joins
        other = lab.cp.start_apiserver("apiserver-b", 6444)
        other.node("late", ["10.244.70.0/24"], ["192.168.77.70"])
        lab.cp.stop("apiserver-b")
    finally:
        lab.cp.start_apiserver()
    wait_for("node-1 routes the Node added while it was cut off", lambda: "10.244.70.0/24" in routes(n1), timeout=HANG)
    wait_for("every agent reconnected", lambda: all("API server reachable" in n.http("/readyz")[1]
                                                     for n in lab.nodes[:4]), timeout=HANG)  # fmt: skip
    lab.api.ok("DELETE", "/api/v1/nodes/late")
    wait_for("and follows its deletion", lambda: "10.244.70.0/24" not in routes(n1), timeout=HANG)


# ---------------------------------------------------------------- RBAC: nothing wider than the own Node


def test_the_agents_token_may_change_only_its_own_nodes_nodeplug_annotations(lab: Lab) -> None:
    assert lab.cp is not None
    n1 = lab.nodes[0]
    agent = lab.cp.client(token=n1.token)
    merge = "application/merge-patch+json"
    assert agent.request("GET", "/api/v1/nodes")[0] == 200
    ok = agent.request(
        "PATCH", f"/api/v1/nodes/{n1.name}", {"metadata": {"annotations": {"nodeplug.io/x": "1"}}}, merge
    )
    assert ok[0] == 200, ok
    cases = [
        ("/api/v1/nodes/node-2", {"metadata": {"annotations": {"nodeplug.io/x": "1"}}}, "only change its own Node"),
        (f"/api/v1/nodes/{n1.name}", {"metadata": {"annotations": {"other.io/x": "1"}}}, "annotations under"),
        (f"/api/v1/nodes/{n1.name}", {"metadata": {"labels": {"a": "b"}}}, "not its spec, labels"),
        (f"/api/v1/nodes/{n1.name}", {"spec": {"unschedulable": True}}, "not its spec, labels"),
    ]
    for path, body, message in cases:
        status, doc = agent.request("PATCH", path, body, merge)
        assert status == 403 and message in doc["message"], (path, body, status, doc)
    strategic = "application/strategic-merge-patch+json"
    status_cases = [
        (n1.name, [{"type": "NetworkUnavailable", "status": "True", "reason": "X"}], "only to False"),
        (n1.name, [{"type": "Ready", "status": "False", "reason": "X"}], "may only set its NetworkUnavailable"),
        ("node-2", [{"type": "NetworkUnavailable", "status": "False", "reason": "X"}], "only change its own Node"),
    ]
    for name, conditions, message in status_cases:
        status, doc = agent.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {"conditions": conditions}},
                                    strategic)  # fmt: skip
        assert status == 403 and message in doc["message"], (name, conditions, status, doc)
    addresses = {"status": {"addresses": [{"type": "InternalIP", "address": "192.168.77.99"}]}}
    assert agent.request("PATCH", f"/api/v1/nodes/{n1.name}/status", addresses, merge)[0] == 403
    assert agent.request("DELETE", "/api/v1/nodes/node-2")[0] == 403
    assert agent.request("GET", "/api/v1/secrets")[0] == 403
    agent.request("PATCH", f"/api/v1/nodes/{n1.name}", {"metadata": {"annotations": {"nodeplug.io/x": None}}}, merge)


def test_each_node_says_its_network_is_available_once_routed_and_says_so_again_when_told_otherwise(lab: Lab) -> None:
    """As cloud node controllers set NetworkUnavailable=True at registration and pod networks clear it: every routed
    node carries NetworkUnavailable=False (reason NodeplugRoutesProgrammed); set back to True by someone, its agent
    sets it to False again."""

    def condition(name: str) -> tuple[str, str] | None:
        for c in lab.api.ok("GET", f"/api/v1/nodes/{name}")["status"].get("conditions") or ():
            if c["type"] == "NetworkUnavailable":
                return c["status"], c["reason"]
        return None

    for node in lab.nodes[:4]:
        wait_for(f"{node.name} available", lambda n=node: condition(n.name) == ("False", "NodeplugRoutesProgrammed"),
                 timeout=60)  # fmt: skip
    n2 = lab.nodes[1]
    unavailable = {"type": "NetworkUnavailable", "status": "True", "reason": "NoRouteCreated", "message": "cloud"}
    lab.api.ok("PATCH", f"/api/v1/nodes/{n2.name}/status", {"status": {"conditions": [unavailable]}},
               "application/strategic-merge-patch+json")  # fmt: skip
    wait_for("node-2 available again", lambda: condition(n2.name) == ("False", "NodeplugRoutesProgrammed"), timeout=60)


# ---------------------------------------------------------------- uninstall


def stand_in_bundle(path: Path) -> Path:
    """A CNI bundle for install-cni to install (it answers VERSION): the lab's pods use the venv's entry point."""
    path.mkdir(parents=True)
    launcher = path / "nodeplug"
    launcher.write_text('#!/bin/sh\necho \'{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0","1.1.0"]}\'\n')
    launcher.chmod(0o755)
    return path


def nodeplugs(node: Node) -> dict[str, Any]:
    """Everything of nodeplug's networks in the node's netns and its subnets file (empty values: none)."""
    tables = node.ns.exec("nft", "list", "tables").splitlines()
    return {
        "routes": sorted([*routes(node, 4), *routes(node, 6)]),
        "vxlan": node.ns.ip("link", "show", "nodeplug.vx", check=False).strip(),
        "bridge": node.ns.ip("link", "show", "nodeplug0", check=False).strip(),
        "tables": [t for t in tables if "nodeplug" in t],
        "subnets": node.subnets_file.exists(),
    }


def test_uninstall_removes_the_cluster_network_and_only_a_new_install_brings_it_back(lab: Lab, tmp_path: Path) -> None:
    """The documented uninstall with the agent running: the agent stands down and removes what it owns, and keeps
    it removed through Node events and a kill -9 restart; the next install brings the network back."""
    n, pod = lab.nodes[2], lab.pods[2]  # node-3: direct routes to node-1 and -2, VXLAN to node-4
    cli = [sys.executable, "-m", "nodeplug.cli", "install-cni", "--root", str(n.root)]
    install = [*cli, "--bundle", str(stand_in_bundle(tmp_path / "bundle")), "--cluster-network",
               "--node-subnets", str(n.subnets_file), "--socket", str(n.root / "run/nodeplug/cni.sock")]  # fmt: skip
    n.ns.exec(*install)  # the conflist (naming the bridge) that the uninstall takes away
    have = nodeplugs(n)
    assert {"10.244.1.0/24", "10.244.4.0/24", "fd44:0:0:2::/64"} <= set(have["routes"]) and all(have.values()), have
    n.ns.ip("route", "add", "10.244.97.0/24", "via", "192.168.77.97", "proto", "static")  # not nodeplug's
    n.ns.exec("nft", "add", "table", "inet", "lab-other")
    readded = False
    try:
        assert n.cni("DEL", pod.ns.name, pod.cid)[0] == 0  # the workloads go first
        out = n.ns.exec(*cli, "--uninstall", timeout=120)
        assert "asked the running agent to remove the cluster network" in out and "the agent removed" in out, out
        assert nodeplugs(n) == {"routes": [], "vxlan": "", "bridge": "", "tables": [], "subnets": False}, out
        assert "10.244.97.0/24" in n.ns.ip("route", "show", "proto", "static")
        assert "table inet lab-other" in n.ns.exec("nft", "list", "tables")
        status, body = n.http("/readyz")
        assert status == 503 and "removed from this node by `nodeplug install-cni --uninstall`" in body, body
        assert "cluster network: uninstall requested" in n.log_tail(20000)
        # Node events do not bring it back (node-1 routes the new Node: the events flowed), nor does a restart
        lab.api.node("after-uninstall", ["10.244.80.0/24"], ["192.168.77.80"])
        wait_for("node-1 routes the new Node", lambda: "10.244.80.0/24" in routes(lab.nodes[0]), timeout=HANG)
        n.kill(signal.SIGKILL)
        n.start()
        wait_for("the restarted agent stays out", lambda: "removed from this node" in n.http("/readyz")[1], HANG)
        time.sleep(1.0)
        assert nodeplugs(n) == {"routes": [], "vxlan": "", "bridge": "", "tables": [], "subnets": False}
        lab.api.ok("DELETE", "/api/v1/nodes/after-uninstall")
        # a fresh install withdraws the request: the agent takes the network up again
        out = n.ns.exec(*install)
        assert "withdrew the uninstall request" in out, out
        n.wait_ready(HANG)
        wait_for("routes, VXLAN device and masquerade table back", lambda: (h := nodeplugs(n))["routes"] ==
                 have["routes"] and h["vxlan"] and h["tables"] and h["subnets"], timeout=HANG)  # fmt: skip
        code, result = n.cni("ADD", pod.ns.name, pod.cid)
        assert code == 0, result
        lab.pods[2] = Pod(n, pod.ns, pod.cid, result)
        readded = True
        assert all_pairs_connected(lab) == []
    finally:
        n.ns.ip("route", "del", "10.244.97.0/24", check=False)
        n.ns.exec("nft", "delete", "table", "inet", "lab-other", check=False)
        if not readded:  # leave the lab as it was for whatever runs after
            n.ns.exec(*install, check=False)
            if n.proc is None:
                n.start()
            with contextlib.suppress(AssertionError):
                n.wait_ready(HANG)
            code, result = n.cni("ADD", pod.ns.name, pod.cid)
            if code == 0:
                lab.pods[2] = Pod(n, pod.ns, pod.cid, result)
