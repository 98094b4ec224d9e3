"""The cluster network never cuts its node off, whatever the Node objects say (scripts/lab/clusterlab.py: five
namespace nodes and a real kube-apiserver + etcd).

node-4 sits behind a router, so it reaches the API server (192.168.77.250, on the other segment) through its default
gateway: a peer's podCIDR holding the API server's address would take that path away, which a node on the API
server's own segment never risks (its connected subnet wins). Each hostile Node is refused with an Event that
``kubectl describe node`` shows, the node keeps reaching the API server, and deleting the Node leaves nothing. A
route planted on the API server's path is withdrawn; a hung API server makes /readyz not ready and its return makes
it ready again; this node's own hostile podCIDR gives pods no address.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.clusterlab import Lab, Node, missing_assets, wait_for
from lab.controlplane import ADMIN_TOKEN, CP_ADDR
from support.kubeassets import binary

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(missing_assets()), reason=missing_assets() or "ok")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = Path(tmp_path_factory.mktemp("lifelines"))
    with Lab(work, l2_nodes=2, routed=True, extra_l2=1) as lab:
        for node in lab.nodes:
            lab.register(node)
        for node in lab.nodes:
            node.start()
        for node in lab.nodes:
            node.wait_ready()
        try:
            yield lab
        finally:
            for node in lab.nodes:
                print(f"----- {node.name} agent log (tail)\n{node.log_tail(3000)}")


def far(lab: Lab) -> Node:
    return next(n for n in lab.nodes if n.ip4.startswith("192.168.78."))


def ours(node: Node) -> str:
    return node.ns.ip("route", "show", "proto", "110") + node.ns.ip("-6", "route", "show", "proto", "110")


def events(lab: Lab, node: str) -> list[dict[str, object]]:
    doc = lab.api.ok("GET", f"/apis/events.k8s.io/v1/namespaces/default/events?fieldSelector=regarding.name%3D{node}")
    return list(doc["items"])


def describe(lab: Lab, node: str) -> str:
    """``kubectl describe node``, from the control plane's netns, as an operator runs it."""
    assert lab.cp is not None
    return lab.cp.ns.exec(str(binary("kubectl")), f"--server=https://{CP_ADDR}:6443", f"--token={ADMIN_TOKEN}",
                          "--insecure-skip-tls-verify", "describe", "node", node)  # fmt: skip


def reaches_api(node: Node) -> bool:
    status, body = node.http("/readyz")
    return status == 200 and "API server reachable" in body


# evil's address: on node-4's segment (auto mode would route it directly) or on the other one (over VXLAN)
NEAR, AWAY = "192.168.78.9", "192.168.77.9"


@pytest.mark.parametrize(
    ("cidrs", "reason", "evil_ip"),
    [
        (["192.168.77.0/24"], "holds 192.168.77.250", NEAR),  # the API server's subnet, seen from behind the router
        (["192.168.77.248/30"], "holds 192.168.77.250", NEAR),
        (["192.168.77.248/30"], "holds 192.168.77.250", AWAY),
        (["128.0.0.0/1"], "never a pod network", NEAR),
        (["172.16.0.0/24"], "outside cluster_network.cluster_cidrs", NEAR),
        (["255.255.255.0/24"], "never a pod network", NEAR),
        (["::ffff:0:0/96"], "never a pod network", NEAR),
    ],
)
def test_a_hostile_peer_podcidr_is_refused_with_an_event_and_the_node_keeps_its_api_server(
    lab: Lab, cidrs: list[str], reason: str, evil_ip: str
) -> None:
    node = far(lab)
    vtep = {"nodeplug.io/vtep-mac": "02:00:00:00:0e:01", "nodeplug.io/vtep-address": evil_ip}
    lab.api.node("evil", cidrs, [evil_ip], vtep)
    try:
        wait_for("node-4 says why it refuses evil's podCIDR", lambda: any(
            reason in str(e.get("note")) and e.get("reportingInstance") == f"nodeplug-{node.name}"
            for e in events(lab, "evil")), timeout=30)  # fmt: skip
        assert "PodCIDRNotRouted" in describe(lab, "evil")
        assert not any(c.split("/")[0] in ours(node) for c in cidrs)
        assert reaches_api(node)
    finally:
        lab.api.ok("DELETE", "/api/v1/nodes/evil")
    wait_for("still reaching the API server after the delete", lambda: reaches_api(node), timeout=30)
    assert not any(c.split("/")[0] in ours(node) for c in cidrs)


def test_a_peer_claiming_this_nodes_own_address_gets_neither_a_route_nor_an_fdb_entry_through_it(lab: Lab) -> None:
    """A Node whose InternalIP and VTEP address are node-4's own: its podCIDR (inside the cluster CIDRs) would be
    routed via node-4 itself, or its VXLAN traffic sent to node-4's own address. Neither path is taken."""
    node = far(lab)
    vtep = {"nodeplug.io/vtep-mac": "02:00:00:00:0e:02", "nodeplug.io/vtep-address": node.ip4}
    lab.api.node("mirror", ["10.244.99.0/24"], [node.ip4], vtep)
    try:
        wait_for("node-4 says why it routes no podCIDR of mirror", lambda: any(
            "an address this node depends on" in str(e.get("note"))
            and e.get("reportingInstance") == f"nodeplug-{node.name}" for e in events(lab, "mirror")),
            timeout=30)  # fmt: skip
        assert "10.244.99." not in ours(node)
        fdb = node.ns.exec("bridge", "fdb", "show", "dev", "nodeplug.vx")
        assert "dst 192.168.77." in fdb and f"dst {node.ip4} " not in fdb, fdb  # its real peers are there, not itself
        assert reaches_api(node)
    finally:
        lab.api.ok("DELETE", "/api/v1/nodes/mirror")


def test_a_route_planted_on_the_api_servers_path_is_withdrawn(lab: Lab) -> None:
    """A route of the agent's protocol to the API server through a gateway that drops everything: the API server
    stops answering, the agent finds its own protocol on the path, withdraws the route and says so."""
    node = far(lab)
    node.ns.ip("route", "add", f"{CP_ADDR}/32", "via", "192.168.78.99", "proto", "110")  # no such host
    wait_for("the planted route withdrawn", lambda: f"{CP_ADDR} via" not in ours(node), timeout=60)
    wait_for("the API server reachable again", lambda: reaches_api(node), timeout=60)
    notes = [str(e.get("note")) for e in events(lab, node.name) if e.get("reason") == "RouteWithdrawn"]
    assert any(f"route to {CP_ADDR}/32 withdrawn" in n for n in notes), notes
    assert "nodeplug_cluster_routes_withdrawn_total 1.0" in node.http("/metrics")[1]


def test_readyz_is_not_ready_while_the_api_server_hangs_and_ready_when_it_returns(lab: Lab) -> None:
    assert lab.cp is not None
    node = lab.nodes[0]
    routes_before = ours(node)
    apiserver = lab.cp.procs["apiserver"]
    apiserver.send_signal(signal.SIGSTOP)
    try:
        wait_for("not ready, saying the API server does not answer", lambda: (
            (r := node.http("/readyz"))[0] == 503 and "API server unreachable" in r[1]), timeout=30)  # fmt: skip
        assert ours(node) == routes_before  # the network keeps its state meanwhile
    finally:
        apiserver.send_signal(signal.SIGCONT)
    wait_for("ready again", lambda: node.http("/readyz")[0] == 200, timeout=60)


@pytest.mark.parametrize("hostile", ["192.168.77.0/24", "128.0.0.0/1"])
def test_this_nodes_own_hostile_podcidr_gives_pods_no_address(lab: Lab, hostile: str) -> None:
    """Node-3's Node object made again with a hostile podCIDR (its own underlay subnet, which holds the API server
    and its gateway; half the IPv4 space): the agent refuses it (readiness, an Event), the subnets file holds no
    podCIDR, and a pod's ADD fails naming the reason, leaving the bridge without an address from it. Made again
    with a good podCIDR, pods get addresses."""
    node = lab.nodes[2]

    def again(cidrs: list[str]) -> None:  # a new Node object: its agent needs a token bound to the new one
        node.kill()
        lab.api.ok("DELETE", f"/api/v1/nodes/{node.name}")
        lab.register(node, cidrs=cidrs)
        node.start()

    again([hostile])
    try:
        wait_for("not ready, naming the refused podCIDR", lambda: (
            (r := node.http("/readyz"))[0] == 503 and f"podCIDR {hostile}" in r[1]), timeout=30)  # fmt: skip
        doc = json.loads(node.subnets_file.read_text())
        assert doc["podCIDRs"] == [] and doc["refused"][0][0] == hostile
        cid = f"own-hostile-{hostile.split('.')[0]}"
        pod = lab.pod_netns(cid)
        code, out = node.cni("ADD", pod.name, cid)
        assert code != 0 and f"refused {hostile}" in json.dumps(out), out
        assert "PodCIDRRefused" in describe(lab, node.name)
        bridge = node.ns.ip("-4", "addr", "show", "dev", "nodeplug0", check=False)
        assert hostile.split("/")[0].rsplit(".", 1)[0] not in bridge and "128.0.0." not in bridge, bridge
    finally:
        again([node.pod4, node.pod6])
    node.wait_ready()


def test_the_doctor_names_a_podcidr_outside_the_cluster_cidrs(lab: Lab) -> None:
    node = lab.nodes[0]

    def line() -> str:
        return node.doctor("inside the cluster CIDRs")

    assert " OK " in line()
    lab.api.node("stray", ["172.16.5.0/24"], ["192.168.77.77"])
    try:
        got = line()
        assert " FAIL " in got and "stray 172.16.5.0/24" in got, got
    finally:
        lab.api.ok("DELETE", "/api/v1/nodes/stray")
