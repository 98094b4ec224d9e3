"""NetworkPolicy on real nftables: the ruleset the compiler makes, applied to a node (a network namespace) whose pods
(namespaces of their own) send real TCP and UDP, over both datapaths: ``bridge`` (pods on a Linux bridge, bridged
traffic sent through the inet hooks) and ``routed`` (each pod's veth ends in the node, its address a host route).

Topology: node ``N`` with pods A (app=a), B (app=b, named port web=8080) and C (app=c), IPv4 and IPv6; a remote
peer ``R`` behind N (another node's pod, or outside), with the addresses 10.2.0.2 and 10.2.0.3. N itself has
10.2.0.1 and fd02::1 (its side of the link to R) and serves TCP and UDP there too, as a host-network pod would.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from cni.policy import kernel, quarantine
from cni.policy.compile import Compiler
from cni.policy.model import NamespaceInfo, PodInfo, parse_policy
from cni.policy.ruleset import Ruleset, diff_script, full_script

from lab.host import unique
from lab.netns import Netns
from support.host import needs_root, sh
from support.serving import Serving, echo_datagrams
from support.wait import wait_for

pytestmark = [needs_root, pytest.mark.skipif(sh("sh", "-c", "command -v nft || true") == "", reason="no nft")]
ip = ipaddress.ip_address
PODS = {"a": 2, "b": 3, "c": 4}
PORTS = (80, 8080)
UDP_PORT = 53
REMOTE = ("10.2.0.2", "10.2.0.3", "fd02::2", "fd02::3")
NODE = ("10.2.0.1", "fd02::1")  # the node's own addresses


class Servers:
    """TCP listeners on PORTS and a UDP echo on UDP_PORT, both families, in a namespace."""

    def __init__(self, ns: Netns) -> None:
        self.serving = Serving()
        for fam, any_addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            for port in PORTS:
                self.serving.connections(ns.call(self._open, fam, socket.SOCK_STREAM, any_addr, port), self._talk)
            self.serving.serve(ns.call(self._open, fam, socket.SOCK_DGRAM, any_addr, UDP_PORT), echo_datagrams)

    @staticmethod
    def _open(fam: int, kind: int, addr: str, port: int) -> socket.socket:
        s = socket.socket(fam, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((addr, port))
        if kind == socket.SOCK_STREAM:
            s.listen(16)
        return s

    @staticmethod
    def _talk(conn: socket.socket) -> None:
        """ "ok", then an echo of whatever comes until the client closes."""
        with conn, contextlib.suppress(OSError):
            conn.sendall(b"ok")
            while data := conn.recv(100):
                conn.sendall(data)

    def close(self) -> None:
        self.serving.close()


def tcp(ns: Netns, dst: str, port: int, src: str | None = None) -> bool:
    def go() -> bool:
        fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            if src:
                s.bind((src, 0))
            try:
                s.connect((dst, port))
                return s.recv(2) == b"ok"
            except OSError:
                return False

    return bool(ns.call(go))


def udp(ns: Netns, dst: str, src: str | None = None) -> bool:
    def go() -> bool:
        fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.settimeout(1.0)
            if src:
                s.bind((src, 0))
            s.sendto(b"hi", (dst, UDP_PORT))
            try:
                return s.recv(10) == b"hi"
            except OSError:
                return False

    return bool(ns.call(go))


class Node:
    def __init__(self, datapath: str) -> None:
        self.datapath = datapath
        self.made: list[Netns] = []
        self.n = self._ns("n")
        self.pods = {name: self._ns(name) for name in PODS}
        self.r = self._ns("r")
        self.n.sysctl("net.ipv4.ip_forward", "1")
        self.n.sysctl("net.ipv6.conf.all.forwarding", "1")
        if datapath == "bridge":
            self.n.ip("link", "add", "br0", "type", "bridge")
            self.n.ip("link", "set", "br0", "up")
            self.n.ip("addr", "add", "10.1.0.1/24", "dev", "br0")
            self.n.ip("addr", "add", "fd01::1/64", "dev", "br0", "nodad")
        for name, k in PODS.items():
            ns = self.pods[name]
            self.n.ip("link", "add", f"v{name}", "type", "veth", "peer", "name", "eth0", "netns", ns.name)
            self.n.ip("link", "set", f"v{name}", "up")
            ns.ip("link", "set", "eth0", "up")
            if datapath == "bridge":
                self.n.ip("link", "set", f"v{name}", "master", "br0")
                ns.ip("addr", "add", f"10.1.0.{k}/24", "dev", "eth0")
                ns.ip("addr", "add", f"fd01::{k}/64", "dev", "eth0", "nodad")
                ns.ip("route", "add", "default", "via", "10.1.0.1")
                ns.ip("-6", "route", "add", "default", "via", "fd01::1")
            else:
                ns.ip("addr", "add", f"10.1.0.{k}/32", "dev", "eth0")
                ns.ip("addr", "add", f"fd01::{k}/128", "dev", "eth0", "nodad")
                self.n.ip("addr", "add", "169.254.1.1/32", "dev", f"v{name}")
                self.n.ip("addr", "add", "fe80::1/64", "dev", f"v{name}", "nodad")
                ns.ip("route", "add", "default", "via", "169.254.1.1", "dev", "eth0", "onlink")
                ns.ip("-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0")
                self.n.ip("route", "add", f"10.1.0.{k}/32", "dev", f"v{name}")
                self.n.ip("-6", "route", "add", f"fd01::{k}/128", "dev", f"v{name}")
        self.n.ip("link", "add", "vr", "type", "veth", "peer", "name", "eth0", "netns", self.r.name)
        self.n.ip("link", "set", "vr", "up")
        self.r.ip("link", "set", "eth0", "up")
        self.n.ip("addr", "add", "10.2.0.1/24", "dev", "vr")
        self.n.ip("addr", "add", "fd02::1/64", "dev", "vr", "nodad")
        for a in REMOTE:
            self.r.ip("addr", "add", f"{a}/{64 if ':' in a else 24}", "dev", "eth0", *(["nodad"] if ":" in a else []))
        self.r.ip("route", "add", "default", "via", "10.2.0.1")
        self.r.ip("-6", "route", "add", "default", "via", "fd02::1")
        self.servers = [Servers(ns) for ns in [*self.pods.values(), self.r, self.n]]
        self.n.call(quarantine.setup)
        self.have = Ruleset()

    def _ns(self, role: str) -> Netns:
        ns = Netns(unique(f"npp{role}-", 6))
        self.made.append(ns)
        return ns

    def close(self) -> None:
        for s in self.servers:
            s.close()
        for ns in self.made:
            ns.delete()

    @staticmethod
    def v4(name: str) -> str:
        return f"10.1.0.{PODS[name]}"

    @staticmethod
    def v6(name: str) -> str:
        return f"fd01::{PODS[name]}"

    def compiler(self) -> Compiler:
        c = Compiler("n")
        c.set_namespace("default", NamespaceInfo("default", {"kubernetes.io/metadata.name": "default"}))
        for name in PODS:
            ports = (("web", "tcp", 8080),) if name == "b" else ()
            c.set_pod(f"default/{name}", PodInfo("default", name, labels={"app": name}, node="n",
                                                  ips=(ip(self.v4(name)), ip(self.v6(name))), ports=ports))  # fmt: skip
        return c

    def apply(self, c: Compiler, full: bool = False) -> None:
        want = c.ruleset()
        self.n.call(kernel.apply, full_script(want) if full else diff_script(self.have, want))
        self.have = want


@pytest.fixture(scope="module", params=["bridge", "routed"])
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    n = Node(request.param)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def c(node: Node) -> Iterator[Compiler]:
    comp = node.compiler()
    node.apply(comp, full=True)
    yield comp
    node.apply(node.compiler(), full=True)  # no policy: every pod open again


def policy(name: str, spec: dict[str, Any]) -> Any:
    from lightkube.resources.networking_v1 import NetworkPolicy

    parsed = parse_policy(NetworkPolicy.from_dict({"metadata": {"namespace": "default", "name": name}, "spec": spec}))
    assert parsed is not None
    return parsed


def test_without_policies_every_pod_is_open(node: Node, c: Compiler) -> None:
    a, b = node.pods["a"], node.pods["b"]
    assert tcp(a, node.v4("b"), 80) and tcp(b, node.v6("a"), 8080) and udp(a, node.v4("c"))
    assert tcp(node.r, node.v4("a"), 80)


def test_default_deny_ingress_drops_new_flows_but_the_isolated_pod_still_connects_out(node: Node, c: Compiler) -> None:
    c.set_policy("default/deny", policy("deny", {"podSelector": {"matchLabels": {"app": "b"}}}))
    node.apply(c)
    a, b = node.pods["a"], node.pods["b"]
    assert not tcp(a, node.v4("b"), 80) and not tcp(a, node.v6("b"), 80) and not udp(a, node.v4("b"))
    assert not tcp(node.r, node.v4("b"), 80, src="10.2.0.2")
    assert tcp(b, node.v4("a"), 80) and tcp(b, node.v6("c"), 8080)  # its own connections' replies pass
    assert tcp(node.n, node.v4("b"), 80) and tcp(node.n, node.v6("b"), 80)  # the node itself (kubelet's probes)
    assert tcp(a, node.v4("c"), 80)  # others stay open
    drops = node.n.call(kernel.counters)
    assert sum(v for k, v in drops.items() if k.startswith("drop-in-")) > 0


def test_ingress_from_a_pod_label_on_one_port_and_a_named_port(node: Node, c: Compiler) -> None:
    c.set_policy("default/b", policy("b", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": 80}]},
        {"from": [{"podSelector": {"matchLabels": {"app": "c"}}}], "ports": [{"port": "web"}]},
    ]}))  # fmt: skip
    node.apply(c)
    a, cc = node.pods["a"], node.pods["c"]
    for fam in (node.v4, node.v6):
        assert tcp(a, fam("b"), 80) and not tcp(a, fam("b"), 8080)
        assert tcp(cc, fam("b"), 8080) and not tcp(cc, fam("b"), 80)  # "web" is 8080 on b
    assert not udp(a, node.v4("b"))


def test_egress_ipblock_with_except_tcp_and_udp(node: Node, c: Compiler) -> None:
    c.set_policy("default/a", policy("a", {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": "10.2.0.0/24", "except": ["10.2.0.3/32"]}},
                           {"ipBlock": {"cidr": "fd02::/64", "except": ["fd02::3/128"]}}]}]}))  # fmt: skip
    node.apply(c)
    a = node.pods["a"]
    assert tcp(a, "10.2.0.2", 80) and udp(a, "10.2.0.2") and tcp(a, "fd02::2", 8080) and udp(a, "fd02::2")
    assert not tcp(a, "10.2.0.3", 80) and not udp(a, "10.2.0.3") and not tcp(a, "fd02::3", 80)
    assert not tcp(a, node.v4("b"), 80)  # not in the block
    assert tcp(node.r, node.v4("a"), 80, src="10.2.0.3")  # ingress is not isolated: the reply is established


def test_egress_to_a_named_port_resolved_on_the_destination_pod(node: Node, c: Compiler) -> None:
    c.set_policy("default/a", policy("a", {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"],
                                           "egress": [{"ports": [{"port": "web"}]}]}))  # fmt: skip
    node.apply(c)
    a = node.pods["a"]
    assert tcp(a, node.v4("b"), 8080) and tcp(a, node.v6("b"), 8080)
    assert not tcp(a, node.v4("b"), 80) and not tcp(a, node.v4("c"), 8080)  # c has no port named web


def test_egress_isolation_covers_the_pods_own_node_which_an_ipblock_can_allow(node: Node, c: Compiler) -> None:
    a, b = node.pods["a"], node.pods["b"]
    assert all(tcp(a, addr, 80) for addr in NODE) and udp(a, NODE[0])
    to_b: dict[str, Any] = {"to": [{"podSelector": {"matchLabels": {"app": "b"}}}]}
    spec: dict[str, Any] = {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"], "egress": [to_b]}
    c.set_policy("default/a", policy("a", spec))
    node.apply(c)
    assert tcp(a, node.v4("b"), 80) and tcp(a, node.v6("b"), 80)
    assert not any(tcp(a, addr, port) for addr in NODE for port in PORTS) and not udp(a, NODE[0])
    assert tcp(node.n, node.v4("a"), 80) and tcp(node.n, node.v6("a"), 80)  # the node's own probes: replies pass
    assert tcp(b, NODE[0], 80) and tcp(b, NODE[1], 80)  # a pod not isolated
    node_block = {"to": [{"ipBlock": {"cidr": "10.2.0.1/32"}}, {"ipBlock": {"cidr": "fd02::1/128"}}],
                  "ports": [{"port": 8080}]}  # fmt: skip
    c.set_policy("default/a", policy("a", {**spec, "egress": [to_b, node_block]}))
    node.apply(c)
    assert tcp(a, NODE[0], 8080) and tcp(a, NODE[1], 8080)
    assert not tcp(a, NODE[0], 80) and not tcp(a, "10.2.0.2", 8080)


def test_egress_to_a_service_is_decided_on_its_endpoint_after_dnat(node: Node, c: Compiler) -> None:
    """A ClusterIP as kube-proxy makes one: DNAT at prerouting, before the forward (a pod endpoint) or input (an
    endpoint on the node's own address) hook where policy looks."""
    services = {"10.96.0.2": node.v4("b"), "10.96.0.3": node.v4("c"), "10.96.0.4": NODE[0]}
    nat = "add table ip svc\nadd chain ip svc pre { type nat hook prerouting priority dstnat; }\n" + "".join(
        f"add rule ip svc pre ip daddr {vip} dnat to {to}\n" for vip, to in services.items())  # fmt: skip
    node.n.exec("nft", "-f", "-", input=nat)
    try:
        a = node.pods["a"]
        assert all(tcp(a, vip, 80) for vip in services)
        c.set_policy("default/a", policy("a", {
            "podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "b"}}}]}]}))  # fmt: skip
        node.apply(c)
        assert tcp(a, "10.96.0.2", 80)  # to b, through its Service
        assert not tcp(a, "10.96.0.3", 80) and not tcp(a, "10.96.0.4", 80)  # c; a host-network endpoint
    finally:
        node.n.exec("nft", "delete", "table", "ip", "svc")


def connect(addr: str) -> socket.socket:
    """A connection to the server on ``addr`` port 80, its greeting read (from inside the calling pod)."""
    s = socket.create_connection((addr, 80), timeout=2)
    assert s.recv(2) == b"ok"
    return s


def talk(s: socket.socket) -> bytes:
    s.sendall(b"again")
    return s.recv(10)


def test_a_policy_change_applies_to_new_flows_while_an_open_connection_goes_on(node: Node, c: Compiler) -> None:
    c.set_policy("default/b", policy("b", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"app": "a"}}}]}]}))  # fmt: skip
    node.apply(c)
    a = node.pods["a"]

    assert tcp(a, node.v4("b"), 80) and not tcp(node.pods["c"], node.v4("b"), 80)
    open_one = a.call(connect, node.v4("b"))
    try:
        c.set_policy("default/b", policy("b", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"app": "c"}}}]}]}))  # fmt: skip
        node.apply(c)
        assert not tcp(a, node.v4("b"), 80) and tcp(node.pods["c"], node.v4("b"), 80)
        assert a.call(talk, open_one) == b"again"  # established before the change: goes on
    finally:
        open_one.close()
    c.set_policy("default/b", None)
    node.apply(c)
    assert tcp(a, node.v4("b"), 80)


def hooked_chains(node: Node) -> set[str]:
    """The chains of the policy table the kernel has on a hook (from ``nft -j``, as the node holds them)."""
    out = node.n.exec("nft", "-j", "list", "table", "inet", "nodeplug-policy")
    return {i["chain"]["name"] for i in json.loads(out)["nftables"] if "chain" in i and "hook" in i["chain"]}


def test_the_first_isolation_hooks_its_direction_and_an_open_connection_goes_on(node: Node, c: Compiler) -> None:
    assert hooked_chains(node) == set()  # no pod isolated: the table is not in any packet's path
    a = node.pods["a"]

    open_one = a.call(connect, node.v4("b"))
    try:
        c.set_policy("default/b", policy("b", {"podSelector": {"matchLabels": {"app": "b"}}}))
        node.apply(c)
        assert hooked_chains(node) == {"ingress"}
        assert not tcp(a, node.v4("b"), 80) and not tcp(a, node.v6("b"), 80)
        assert a.call(talk, open_one) == b"again"  # opened before the table was hooked: goes on
    finally:
        open_one.close()
    c.set_policy("default/b", None)
    node.apply(c)
    assert hooked_chains(node) == set()
    assert tcp(a, node.v4("b"), 80)


def test_a_quarantined_address_is_cut_off_until_released_with_its_rules(node: Node, c: Compiler) -> None:
    a = node.pods["a"]
    assert node.n.call(quarantine.hold, [node.v4("b"), node.v6("b")])
    assert not tcp(a, node.v4("b"), 80) and not tcp(a, node.v6("b"), 80) and not tcp(node.pods["b"], node.v4("a"), 80)
    assert node.n.call(quarantine.held) == {node.v4("b"), node.v6("b")}
    c.set_policy("default/b", policy("b", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"app": "a"}}}]}]}))  # fmt: skip
    want = c.ruleset()
    node.n.call(kernel.apply, diff_script(node.have, want) + quarantine.script("delete", [node.v4("b"), node.v6("b")]))
    node.have = want
    # A's neighbour entry for B went FAILED while B's answers were dropped; the kernel resolves it again on the next
    # packet, which a single connect with a 1-second timeout may not see (a real client's SYN is retransmitted).
    wait_for("A reaches B over IPv6 once B is released", lambda: tcp(a, node.v6("b"), 80), timeout=20)
    assert tcp(a, node.v4("b"), 80) and not tcp(node.pods["c"], node.v4("b"), 80)
    assert node.n.call(quarantine.held) == set()


def test_thousands_of_excepts_and_ports_load_as_one_transaction_and_still_decide_right(node: Node, c: Compiler) -> None:
    excepts = [f"10.2.{i // 256}.{i % 256}/32" for i in range(3, 3000, 2)]  # 10.2.0.3, .5, ... (odd hosts)
    ports: list[dict[str, Any]] = [{"port": p, "endPort": p + 1, "protocol": "TCP"} for p in range(70, 90, 2)]
    ports += [{"port": "no-pod-has-this-name"}, {"port": 53, "protocol": "UDP"}, {"protocol": "SCTP"}]
    c.set_policy("default/a", policy("a", {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": "10.2.0.0/16", "except": excepts}},
                           {"podSelector": {"matchLabels": {"nobody": "has-this"}}}], "ports": ports}]}))  # fmt: skip
    node.apply(c)
    a = node.pods["a"]
    assert tcp(a, "10.2.0.2", 80) and udp(a, "10.2.0.2")
    assert not tcp(a, "10.2.0.3", 80) and not tcp(a, "10.2.0.2", 8080)


@pytest.fixture
def bare() -> Iterator[Netns]:
    """A network namespace of its own (no quarantine in it until a test makes one)."""
    ns = Netns(unique("nppq-", 6))
    try:
        yield ns
    finally:
        ns.delete()


def test_hold_without_a_quarantine_table_is_no_quarantine_and_changes_nothing(bare: Netns) -> None:
    assert bare.call(quarantine.hold, ["10.9.0.5", "fd09::5/128"]) is False
    assert bare.exec("nft", "list", "ruleset").strip() == ""


def test_hold_puts_both_families_in_and_keeps_what_is_held(bare: Netns) -> None:
    bare.call(quarantine.setup)
    assert bare.call(quarantine.hold, ["10.9.0.5/32", "fd09::5", "10.9.0.6"]) is True
    assert bare.call(quarantine.hold, ["10.9.0.5", "fd09::5"]) is True  # already held: still held, no error
    assert bare.call(quarantine.held) == {"10.9.0.5", "10.9.0.6", "fd09::5"}


def test_hold_fails_closed_and_adds_nothing_when_the_kernel_refuses(bare: Netns) -> None:
    """A quarantine table the kernel cannot put an address into (here its IPv4 set holds ports): the call fails
    naming the addresses and the kernel's reason, and the IPv6 address of the same call is not held either (one
    transaction)."""
    bare.exec("nft", "-f", "-", input=(
        f"add table inet {quarantine.TABLE}\n"
        f"add set inet {quarantine.TABLE} q4 {{ type inet_service; }}\n"
        f"add set inet {quarantine.TABLE} q6 {{ type ipv6_addr; }}\n"))  # fmt: skip
    with pytest.raises(quarantine.QuarantineError) as e:
        bare.call(quarantine.hold, ["10.9.0.5", "fd09::5"])
    assert "10.9.0.5, fd09::5" in str(e.value) and len(str(e.value)) > len("quarantine 10.9.0.5, fd09::5: ")
    assert bare.call(quarantine.held) == set()


def test_held_reads_what_nft_lists_however_many_and_nothing_without_the_table(bare: Netns) -> None:
    """What the redirect reads at every sync: the held addresses, read over nfnetlink, are those ``nft`` lists,
    for sets too big for one message of the kernel's dump; no table (no policy enforcement here) holds nothing."""
    assert bare.call(quarantine.held) == set()
    bare.call(quarantine.setup)
    assert bare.call(quarantine.held) == set()
    v4 = [f"10.9.{i // 250}.{i % 250 + 1}" for i in range(700)]
    v6 = [f"fd09::{i:x}" for i in range(1, 701)]
    assert bare.call(quarantine.hold, v4 + v6) is True
    listed: set[str] = set()
    for v in (4, 6):
        out = json.loads(bare.exec("nft", "-j", "list", "set", "inet", quarantine.TABLE, f"q{v}"))
        listed |= {e for item in out["nftables"] for e in (item.get("set") or {}).get("elem", [])}
    assert len(listed) == 1400
    assert bare.call(quarantine.held) == listed
