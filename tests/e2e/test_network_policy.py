"""NetworkPolicy across nodes against a real kube-apiserver + etcd (``lab.clusterlab``), in both route modes.

Three namespace nodes, each with its own agent (cluster network in ``auto`` mode and network policy): node-1 and
node-2 on one segment (routed ``direct``), node-3 behind a router (``vxlan``). Pods are made as kubelet makes them:
the Pod object first, then CNI ADD with its ``K8S_POD_*`` arguments, then its addresses in the Pod's status. The
server pod is on node-1; clients reach it from node-2 (direct) and node-3 (VXLAN), over IPv4 and IPv6.
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.clusterlab import OUTSIDE, Lab, Netns, Pod, missing_assets, wait_for
from support.serving import Serving

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok")]

HANG = 60  # bounds a hang: three agents and an API server share two cores with whatever else runs here
PORTS = (80, 8080)
OUTSIDE_2 = "203.0.113.11"


class Servers:
    """TCP servers on PORTS, both families, in a namespace: each connection gets "ok"."""

    def __init__(self, ns: Netns) -> None:
        self.serving = Serving()
        for fam, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            for port in PORTS:
                self.serving.serve(ns.call(self._listen, fam, addr, port), self._serve)

    @staticmethod
    def _listen(fam: int, addr: str, port: int) -> socket.socket:
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((addr, port))
        s.listen(32)
        return s

    @staticmethod
    def _serve(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = s.accept()
                with conn:
                    conn.sendall(b"ok")

    def close(self) -> None:
        self.serving.close()


def reaches(src: Netns, dst: str, port: int = 80) -> bool:
    def go() -> bool:
        try:
            with socket.create_connection((dst, port), timeout=1.5) as c:
                return c.recv(2) == b"ok"
        except OSError:
            return False

    return bool(src.call(go))


class World:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        n1, n2, n3 = lab.nodes
        self.server = lab.add_k8s_pod(n1, "prod", "server", {"app": "server"},
                                      [{"name": "web", "containerPort": 8080}])  # fmt: skip
        self.client = lab.add_k8s_pod(n2, "prod", "client", {"app": "client"})
        self.other = lab.add_k8s_pod(n3, "prod", "other", {"app": "other"})
        self.dev = lab.add_k8s_pod(n3, "dev", "client", {"app": "client"})
        self.out = next(n for n in lab.netns if n.name.endswith("-out"))
        self.out.ip("addr", "add", f"{OUTSIDE_2}/24", "dev", "eth0")
        self.servers = [Servers(p.ns) for p in (self.server, self.client, self.other, self.dev)] + [Servers(self.out)]

    def policy(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self.lab.api.create({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                             "metadata": {"name": name, "namespace": namespace}, "spec": spec})  # fmt: skip

    def delete_policy(self, namespace: str, name: str) -> None:
        self.lab.api.ok("DELETE", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{name}")

    def seen(self, client: Pod, server: Pod, port: int = 80) -> tuple[bool, bool]:
        return reaches(client.ns, server.ip4, port), reaches(client.ns, server.ip6, port)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = Path(tmp_path_factory.mktemp("netpol"))
    with Lab(work, l2_nodes=2, routed=True) as lab:
        for node in lab.nodes:
            lab.register(node)
        for node in lab.nodes:
            node.start()
        for node in lab.nodes:
            node.wait_ready()
            wait_for(f"{node.name}: policy ready", lambda n=node: "network_policy: ready" in n.http("/readyz")[1],
                     timeout=HANG)  # fmt: skip
        lab.namespace("prod", {"team": "prod"})
        lab.namespace("dev", {"team": "dev"})
        lab.namespace("open", {})
        w = World(lab)
        try:
            yield w
        finally:
            for s in w.servers:
                s.close()
            for node in lab.nodes:
                print(f"----- {node.name} agent log (tail)\n{node.log_tail(3000)}")


@pytest.fixture
def w(world: World) -> Iterator[World]:
    yield world
    for name in ("deny", "allow", "egress"):
        with contextlib.suppress(RuntimeError):
            world.delete_policy("prod", name)
    wait_for("every policy gone: all open", lambda: world.seen(world.client, world.server) == (True, True)
             and world.seen(world.dev, world.server) == (True, True), timeout=HANG)  # fmt: skip


DENY = {"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"]}


def test_no_policy_leaves_every_pod_open_across_nodes(w: World) -> None:
    for client in (w.client, w.other, w.dev):  # the first packets may wait for neighbour discovery
        wait_for(f"{client.node.name} reaches the server", lambda c=client: w.seen(c, w.server) == (True, True),
                 timeout=HANG)  # fmt: skip


def test_default_deny_across_both_route_modes_and_the_node_itself_still_probes(w: World) -> None:
    w.policy("prod", "deny", DENY)
    wait_for("deny in force", lambda: w.seen(w.client, w.server) == (False, False), timeout=HANG)
    assert w.seen(w.other, w.server) == (False, False)  # over VXLAN
    assert reaches(w.server.node.ns, w.server.ip4) and reaches(w.server.node.ns, w.server.ip6)  # kubelet's probes
    assert w.seen(w.server, w.client) == (True, True)  # the isolated pod connects out; replies pass
    metrics = w.server.node.http("/metrics")[1]
    assert 'nodeplug_policy_policies{scope="node"} 1.0' in metrics


def test_allow_by_namespace_label_and_by_pod_label(w: World) -> None:
    w.policy("prod", "allow", {"podSelector": {"matchLabels": {"app": "server"}}, "ingress": [
        {"from": [{"namespaceSelector": {"matchLabels": {"team": "dev"}}}]}]})  # fmt: skip
    wait_for("the policy in force", lambda: w.seen(w.client, w.server) == (False, False), timeout=HANG)
    assert w.seen(w.dev, w.server) == (True, True)
    assert w.seen(w.other, w.server) == (False, False)
    w.delete_policy("prod", "allow")
    w.policy("prod", "allow", {"podSelector": {"matchLabels": {"app": "server"}}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]})  # fmt: skip
    wait_for("the new policy in force", lambda: w.seen(w.dev, w.server) == (False, False), timeout=HANG)
    assert w.seen(w.client, w.server) == (True, True)  # same label, this namespace
    assert w.seen(w.other, w.server) == (False, False)


def test_allow_by_named_port(w: World) -> None:
    w.policy("prod", "allow", {"podSelector": {"matchLabels": {"app": "server"}},
                               "ingress": [{"ports": [{"port": "web"}]}]})  # fmt: skip
    wait_for("the policy in force", lambda: w.seen(w.other, w.server, 80) == (False, False), timeout=HANG)
    assert w.seen(w.other, w.server, 8080) == (True, True)
    assert w.seen(w.client, w.server, 8080) == (True, True)


def test_egress_ipblock_with_except(w: World) -> None:
    w.policy("prod", "egress", {"podSelector": {"matchLabels": {"app": "client"}}, "policyTypes": ["Egress"],
                                "egress": [{"to": [{"ipBlock": {"cidr": "203.0.113.0/24",
                                                                "except": [f"{OUTSIDE}/32"]}}]}]})  # fmt: skip
    wait_for("egress in force", lambda: not reaches(w.client.ns, OUTSIDE), timeout=HANG)  # checked from here on
    assert reaches(w.client.ns, OUTSIDE_2)
    assert w.seen(w.client, w.server) == (False, False)  # not in the block
    assert reaches(w.dev.ns, OUTSIDE)  # another namespace's client: not selected


def test_a_new_pod_of_an_isolated_namespace_is_never_reachable_before_its_rules(w: World) -> None:
    w.policy("prod", "deny", {"podSelector": {}, "policyTypes": ["Ingress"]})
    wait_for("deny in force", lambda: w.seen(w.client, w.server) == (False, False), timeout=HANG)
    fresh = w.lab.add_k8s_pod(w.lab.nodes[0], "prod", "fresh", {"app": "fresh"}, report=False)
    servers = Servers(fresh.ns)
    try:
        # ADD has answered: its rules are in place already, before the status even names its addresses
        assert not reaches(w.client.ns, fresh.ip4) and not reaches(w.client.ns, fresh.ip6)
        assert reaches(fresh.ns, w.dev.ip4)  # not quarantined: its own rules (egress open) were there at once
        w.lab.report(fresh)
        assert not reaches(w.other.ns, fresh.ip4)
    finally:
        servers.close()
    # and in a namespace without policies a new pod is reachable as soon as ADD answers
    opened = w.lab.add_k8s_pod(w.lab.nodes[0], "open", "fresh", {}, report=False)
    servers = Servers(opened.ns)
    try:
        assert reaches(w.client.ns, opened.ip4)
    finally:
        servers.close()


def test_agent_kill9_and_the_api_server_away_never_open_traffic(w: World) -> None:
    lab = w.lab
    assert lab.cp is not None
    w.policy("prod", "deny", DENY)
    wait_for("deny in force", lambda: w.seen(w.client, w.server) == (False, False), timeout=HANG)
    n1 = lab.nodes[0]
    n1.kill(signal.SIGKILL)
    assert w.seen(w.client, w.server) == (False, False) and w.seen(w.other, w.server) == (False, False)
    # a pod made while the agent is down (the entry point works standalone): quarantined, even in a namespace
    # without policies, until the agent has its rules
    late = lab.add_k8s_pod(n1, "open", "late", {})
    servers = Servers(late.ns)
    try:
        assert not reaches(w.client.ns, late.ip4)
        n1.start()
        n1.wait_ready(HANG)
        wait_for("the agent has its rules: out of quarantine", lambda: reaches(w.client.ns, late.ip4), timeout=HANG)
        assert w.seen(w.client, w.server) == (False, False)
        lab.cp.stop("apiserver")
        try:
            wait_for("the agent notices", lambda: "policy rules kept" in n1.http("/readyz")[1], timeout=HANG)
            assert w.seen(w.client, w.server) == (False, False)
            assert reaches(w.client.ns, late.ip4)  # what was allowed stays allowed
        finally:
            lab.cp.start_apiserver()
    finally:
        servers.close()
    assert w.seen(w.client, w.server) == (False, False)
