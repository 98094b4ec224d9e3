"""The cluster network's pure core: Node objects parsed (hostile input), the plan for each mode, and the diff."""

from __future__ import annotations

import ipaddress
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkube.resources.core_v1 import Node

from cni.cluster.model import VTEP_ADDRESS, VTEP_MAC, NodeInfo, Vtep, parse_mac, parse_node, slim_node
from cni.cluster.plan import NEVER_POD_SPACE, Local, RouteSpec, State, changes, desired, trespasses
from cni.nodesubnets import NodeSubnets, SubnetsError, read

net = ipaddress.ip_network
ip = ipaddress.ip_address


def as_node(obj: dict[str, Any]) -> Node:
    """A Node as the agent gets it: decoded into lightkube's model, checked against the API's schema."""
    return Node.from_dict(obj)


def node_obj(name: str, cidrs: Any = None, ips: Any = None, notes: Any = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if notes is not None:
        meta["annotations"] = notes
    spec = {"podCIDRs": cidrs} if cidrs is not None else {}
    status = {
        "addresses": [{"type": "InternalIP", "address": a} for a in ips or []] + [{"type": "Hostname", "address": name}]
    }
    return {"metadata": meta, "spec": spec, "status": status}


# ---------------------------------------------------------------- parsing


def test_parse_node_takes_one_cidr_per_family_and_internal_ips_in_order() -> None:
    info = parse_node(as_node(node_obj("a", ["10.244.1.0/24", "fd44:0:0:1::/64", "10.244.9.0/24"],
                                       ["fd77::1", "192.168.1.1"],
                                       {VTEP_MAC: "0A:00:00:00:00:01", VTEP_ADDRESS: "192.168.1.1"})))  # fmt: skip
    assert info is not None
    assert info.pod_cidrs == (net("10.244.1.0/24"), net("fd44:0:0:1::/64"))
    assert info.internal_ips == (ip("fd77::1"), ip("192.168.1.1"))
    assert info.vtep == Vtep("0a:00:00:00:00:01", ip("192.168.1.1"))
    assert info.problems == ("spec.podCIDRs[2]: a second IPv4 network (10.244.9.0/24) is ignored",)


def test_parse_node_falls_back_to_podcidr_and_names_every_bad_field() -> None:
    obj = node_obj(
        "b", None, ["not-an-ip", "127.0.0.1", "10.0.0.2"], {VTEP_MAC: "01:00:5e:00:00:01", VTEP_ADDRESS: "x"}
    )
    obj["spec"] = {"podCIDR": "10.244.2.1/24"}  # host bits set: refused
    info = parse_node(as_node(obj))
    assert info is not None and info.pod_cidrs == () and info.internal_ips == (ip("10.0.0.2"),) and info.vtep is None
    text = " | ".join(info.problems)
    for part in ("spec.podCIDRs[0]", "status.addresses[0]", "status.addresses[1]", VTEP_MAC, VTEP_ADDRESS):
        assert part in text


@pytest.mark.parametrize("obj", [{}, {"metadata": {}}, {"metadata": {"name": ""}}, {"metadata": {"name": "n" * 254}}])
def test_parse_node_without_a_name_is_none(obj: dict[str, Any]) -> None:
    assert parse_node(as_node(obj)) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=40) | st.sampled_from(
        ["10.244.1.0/24", "fd44::/64", "1.2.3.4", "::1", "0.0.0.0/0", "02:00:00:00:00:01", "InternalIP"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["name", "podCIDRs", "podCIDR", "addresses", "type", "address", "annotations", VTEP_MAC,
                         VTEP_ADDRESS, "spec", "status", "metadata"]), inner, max_size=5),
    max_leaves=30,
)  # fmt: skip


node_shaped = st.fixed_dictionaries({}, optional={
    "metadata": st.fixed_dictionaries({}, optional={
        "name": st.text(max_size=8) | st.just("x" * 300),
        "annotations": st.dictionaries(st.sampled_from([VTEP_MAC, VTEP_ADDRESS, "other"]), json_values, max_size=3)}),
    "spec": st.fixed_dictionaries({}, optional={
        "podCIDRs": st.lists(json_values.filter(lambda v: isinstance(v, str)), max_size=4),
        "podCIDR": st.sampled_from(["10.244.1.0/24", "fd44::/64", "1.2.3.4", "x"])}),
    "status": st.fixed_dictionaries({}, optional={"addresses": st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["InternalIP", "Hostname"]),
        "address": st.sampled_from(["10.0.0.1", "fd00::1", "127.0.0.1", "0.0.0.0", "x", "ff02::1", "169.254.1.1"])}),
        max_size=4)}),
})  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.one_of(node_shaped, st.dictionaries(st.sampled_from(["metadata", "spec", "status", "kind"]), json_values,
                                                max_size=4)))  # fmt: skip
def test_parse_node_never_raises_and_keeps_its_promises(obj: dict[str, Any]) -> None:
    """Any JSON: refused at the edge (not of the Node schema), or a Node whose parse keeps its promises (or None
    for one without a usable name)."""
    try:
        node = as_node(obj)
    except msgspec.ValidationError:
        return
    info = parse_node(node)
    if info is None:
        assert not (node.metadata and node.metadata.name) or len(node.metadata.name) > 253
        return
    assert node.metadata is not None and info.name == node.metadata.name
    versions = [c.version for c in info.pod_cidrs]
    assert len(versions) == len(set(versions)) <= 2
    assert all(c.prefixlen <= c.max_prefixlen - 2 for c in info.pod_cidrs)
    assert all(not (a.is_loopback or a.is_multicast or a.is_unspecified) for a in info.internal_ips)
    assert info.vtep is None or parse_mac(info.vtep.mac) == info.vtep.mac
    assert len(info.problems) <= 8


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["metadata", "spec", "status", "kind"]), json_values, max_size=4))
def test_a_slim_node_parses_as_the_whole_one(obj: dict[str, Any]) -> None:
    """The list+watch keeps only :func:`slim_node` of each Node: nothing the network reads may be lost."""
    slim = slim_node(obj)
    assert slim_node(slim) == slim
    try:
        whole = parse_node(as_node(obj))
    except msgspec.ValidationError:  # refused whole; the slim one may still be a Node (what it dropped was bad)
        return
    assert parse_node(as_node(slim)) == whole


def test_a_slim_node_drops_what_the_network_never_reads() -> None:
    obj = node_obj("a", ["10.244.1.0/24"], ["10.0.0.1"], {VTEP_MAC: "02:00:00:00:00:01", "other/note": "x" * 1000})
    obj["status"]["images"] = [{"names": ["registry/image:tag"] * 5, "sizeBytes": 1}] * 50
    obj["metadata"]["managedFields"] = [{"manager": "kubelet"}] * 20
    slim = slim_node(obj)
    assert "images" not in slim["status"] and "managedFields" not in slim["metadata"]
    assert slim["metadata"]["annotations"] == {VTEP_MAC: "02:00:00:00:00:01"}
    assert len(json.dumps(slim)) < len(json.dumps(obj)) / 10


# ---------------------------------------------------------------- the plan


LAN = net("192.168.77.0/24")
ME = Local(
    "n1",
    (net("10.244.1.0/24"), net("fd44:0:0:1::/64")),
    (LAN, net("fd77::/64")),
    Vtep("02:00:00:00:00:01", ip("192.168.77.1")),
)


def peer(name: str, i: int, under: str, v6_under: str | None = None, vtep: bool = True) -> NodeInfo:
    ips = (ip(under),) + ((ip(v6_under),) if v6_under else ())
    return NodeInfo(name, (net(f"10.244.{i}.0/24"), net(f"fd44:0:0:{i}::/64")), ips,
                    Vtep(f"02:00:00:00:00:{i:02x}", ip(under)) if vtep else None)  # fmt: skip


def test_auto_is_direct_on_the_segment_and_vxlan_beyond_it() -> None:
    nodes = [peer("n1", 1, "192.168.77.1"), peer("n2", 2, "192.168.77.2", "fd77::2"), peer("n4", 4, "192.168.78.4")]
    want = desired(ME, nodes, "auto")
    assert want.state.routes[net("10.244.2.0/24")] == RouteSpec(net("10.244.2.0/24"), ip("192.168.77.2"), False)
    assert want.state.routes[net("fd44:0:0:2::/64")] == RouteSpec(net("fd44:0:0:2::/64"), ip("fd77::2"), False)
    assert want.state.routes[net("10.244.4.0/24")] == RouteSpec(net("10.244.4.0/24"), ip("10.244.4.0"), True)
    assert want.state.routes[net("fd44:0:0:4::/64")] == RouteSpec(net("fd44:0:0:4::/64"), ip("fd44:0:0:4::"), True)
    assert want.state.fdb == {"02:00:00:00:00:04": ip("192.168.78.4")}
    assert want.state.neigh == {ip("10.244.4.0"): "02:00:00:00:00:04", ip("fd44:0:0:4::"): "02:00:00:00:00:04"}
    assert want.paths == {("n2", 4): "direct", ("n2", 6): "direct", ("n4", 4): "vxlan", ("n4", 6): "vxlan"}
    assert want.unrouted == {}


def test_each_mode_says_why_a_peer_is_not_routed() -> None:
    far_no_vtep = peer("n4", 4, "192.168.78.4", vtep=False)
    assert "not on a subnet" in desired(ME, [far_no_vtep], "direct").unrouted[("n4", 4)]
    assert "not published a VTEP" in desired(ME, [far_no_vtep], "vxlan").unrouted[("n4", 4)]
    auto = desired(ME, [far_no_vtep], "auto").unrouted[("n4", 6)]
    assert "no IPv6 InternalIP" in auto and "not published a VTEP" in auto
    v6_vtep = peer("n5", 5, "192.168.78.5")._replace(vtep=Vtep("02:00:00:00:00:05", ip("fd78::5")))
    assert "other underlay family" in desired(ME, [v6_vtep], "vxlan").unrouted[("n5", 4)]
    assert (
        "this node has no VXLAN device" in desired(ME._replace(vtep=None), [far_no_vtep], "vxlan").unrouted[("n4", 4)]
    )


def test_conflicts_are_settled_by_name_whatever_the_order() -> None:
    a = peer("a", 7, "192.168.78.7")
    b = peer("b", 7, "192.168.78.8")._replace(vtep=Vtep("02:00:00:00:00:09", ip("192.168.78.8")))  # same podCIDR
    c = peer("c", 9, "192.168.78.9")._replace(vtep=a.vtep)  # a's VTEP MAC
    mine = peer("m", 1, "192.168.77.9")  # overlaps this node's own podCIDR
    for order in ([a, b, c, mine], [mine, c, b, a]):
        want = desired(ME, order, "auto")
        assert want.paths[("a", 4)] == "vxlan"
        assert "overlaps node a's" in want.unrouted[("b", 4)]
        assert "already node a's" in want.unrouted[("c", 4)]
        assert "overlaps node n1's" in want.unrouted[("m", 4)]


def test_a_podcidr_in_the_underlay_or_outside_the_cluster_cidrs_gets_no_route() -> None:
    lan_half = peer("h", 9, "192.168.78.9")._replace(pod_cidrs=(net("192.168.77.128/25"),))
    wide = peer("w", 8, "192.168.77.8")._replace(pod_cidrs=(net("172.16.0.0/16"), net("fd44:0:0:8::/64")))
    for mode in ("direct", "vxlan", "auto"):
        want = desired(ME, [lan_half, peer("n2", 2, "192.168.77.2", "fd77::2")], mode)
        assert "overlaps 192.168.77.0/24, a subnet this node is connected to" in want.unrouted[("h", 4)]
        assert net("192.168.77.128/25") not in want.state.routes and ("n2", 4) in want.paths
    fenced = ME._replace(cluster=(net("10.244.0.0/16"), net("fd44::/48")))
    want = desired(fenced, [wide], "auto")
    assert "outside cluster_network.cluster_cidrs" in want.unrouted[("w", 4)]
    assert want.paths == {("w", 6): "vxlan"} and list(want.state.routes) == [net("fd44:0:0:8::/64")]
    assert desired(ME, [wide], "auto").paths[("w", 4)] == "direct"  # no cluster CIDRs configured: not fenced


# The routed node of the lab: behind a router, reaching the API server (on another subnet) through its gateway.
FAR = Local(
    "far",
    (net("10.244.4.0/24"), net("fd44:0:0:4::/64")),
    (net("192.168.78.0/24"), net("fd78::/64")),
    Vtep("02:00:00:00:00:04", ip("192.168.78.4")),
    lifelines=(ip("192.168.77.250"), ip("192.168.78.254"), ip("fd78::254"), ip("192.168.78.4"), ip("fd78::4")),
)


@pytest.mark.parametrize(
    ("cidr", "why"),
    [
        ("192.168.77.0/24", "holds 192.168.77.250, an address this node depends on"),  # the API server's subnet
        ("192.168.77.248/30", "holds 192.168.77.250"),
        ("172.16.0.0/12", "broader than /16"),
        ("128.0.0.0/1", "never a pod network"),
        ("64.0.0.0/2", "never a pod network"),
        ("255.255.255.0/24", "overlaps 240.0.0.0/4, which is never a pod network"),
        ("127.0.0.0/24", "never a pod network"),
        ("169.254.0.0/24", "never a pod network"),
        ("::ffff:0:0/96", "overlaps ::ffff:0:0/96"),
        ("fe80::/64", "never a pod network"),
        ("192.168.78.0/25", "a subnet this node is connected to"),
    ],
)
def test_a_podcidr_that_would_take_a_lifeline_is_refused_as_a_peers_and_as_this_nodes(cidr: str, why: str) -> None:
    bad = NodeInfo("evil", (net(cidr),), (ip("192.168.78.9"),), Vtep("02:00:00:00:00:99", ip("192.168.78.9")))
    for mode in ("direct", "vxlan", "auto"):
        want = desired(FAR, [bad, peer("n2", 2, "192.168.78.2")], mode)
        assert why in want.unrouted[("evil", net(cidr).version)]
        assert net(cidr) not in want.state.routes and ("n2", 4) in want.paths
    own = desired(FAR._replace(pod_cidrs=(net(cidr), net("fd44:0:0:4::/64"))), [], "auto")
    assert own.own == (net("fd44:0:0:4::/64"),)
    assert len(own.own_refused) == 1 and own.own_refused[0][0] == net(cidr) and why in own.own_refused[0][1]


def test_a_peer_claiming_this_nodes_address_gets_no_route_or_fdb_entry() -> None:
    twin = NodeInfo(
        "twin", (net("10.244.9.0/24"),), (ip("192.168.78.4"),), Vtep("02:00:00:00:00:09", ip("192.168.78.4"))
    )
    for mode in ("direct", "vxlan", "auto"):
        want = desired(FAR, [twin], mode)
        assert want.state.routes == {} and want.state.fdb == {}, mode
    assert "an address this node depends on" in desired(FAR, [twin], "auto").unrouted[("twin", 4)]


def test_with_cluster_cidrs_a_broad_podcidr_inside_them_is_accepted() -> None:
    wide = NodeInfo("w", (net("10.128.0.0/12"),), (ip("192.168.78.8"),), Vtep("02:00:00:00:00:08", ip("192.168.78.8")))
    assert "broader than /16" in desired(FAR, [wide], "auto").unrouted[("w", 4)]
    assert desired(FAR._replace(cluster=(net("10.0.0.0/8"),)), [wide], "auto").paths == {("w", 4): "direct"}


addresses = st.one_of(
    st.builds(lambda n: str(ipaddress.IPv4Address(n)), st.integers(0, 2**32 - 1)),
    st.sampled_from(["192.168.77.250", "192.168.78.254", "192.168.78.4", "10.244.4.1", "fd78::254", "::1"]),
)
cidrs = st.one_of(
    st.builds(lambda a, p: str(ipaddress.ip_network(f"{a}/{p}", strict=False)), addresses, st.integers(0, 30)),
    st.sampled_from(["192.168.77.0/24", "192.168.78.0/24", "0.0.0.0/0", "fd78::/64", "::/0", "fd44::/48"]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(cidrs, max_size=3), st.lists(addresses, max_size=2), st.booleans()), min_size=1, max_size=6
    ),
    st.lists(cidrs, max_size=2),
    st.sampled_from(["direct", "vxlan", "auto"]),
    st.lists(st.sampled_from(["10.0.0.0/8", "192.168.0.0/16", "fd44::/48"]), max_size=2, unique=True),
)
def test_no_plan_ever_routes_an_address_the_node_depends_on(
    peers: list[tuple[list[str], list[str], bool]], own: list[str], mode: str, cluster: list[str]
) -> None:
    """Whatever the Nodes say: no route (and no own pod network) covers a lifeline, a connected subnet or space that
    is never a pod network, and none reaches outside the cluster CIDRs or past the broadness limit."""
    nodes = []
    for i, (pc, ips, with_vtep) in enumerate(peers):
        notes = {VTEP_MAC: f"02:00:00:00:01:{i:02x}", VTEP_ADDRESS: ips[0]} if with_vtep and ips else {}
        info = parse_node(as_node(node_obj(f"p{i}", pc, ips, notes)))
        assert info is not None
        nodes.append(info)
    me = parse_node(as_node(node_obj("far", own, ["192.168.78.4"])))
    assert me is not None
    local = FAR._replace(pod_cidrs=me.pod_cidrs, cluster=tuple(net(c) for c in cluster))
    want = desired(local, [me, *nodes], mode)  # type: ignore[arg-type]
    taken = [*want.state.routes, *want.own]
    for c in taken:
        assert not any(a in c for a in local.lifelines), c
        assert not any(c.overlaps(x) for x in (*local.connected, *NEVER_POD_SPACE) if x.version == c.version), c
        if local.cluster:
            assert any(c.version == x.version and c.subnet_of(x) for x in local.cluster), c  # type: ignore[arg-type]
        else:
            assert c.prefixlen >= (16 if c.version == 4 else 48), c
    for a, b in itertools.combinations(taken, 2):
        assert a.version != b.version or not a.overlaps(b), (a, b)  # type: ignore[arg-type]
    assert not any(r.gateway in local.lifelines for r in want.state.routes.values())
    assert not any(u in local.lifelines for u in want.state.fdb.values())


def test_changes_touch_only_what_differs() -> None:
    want = desired(ME, [peer("n2", 2, "192.168.77.2", "fd77::2"), peer("n4", 4, "192.168.78.4")], "auto").state
    assert not changes(want, State(dict(want.routes), dict(want.fdb), dict(want.neigh)))
    stale = RouteSpec(net("10.244.9.0/24"), ip("192.168.77.9"), False)
    have = State(
        {**want.routes, stale.dst: stale},
        {"02:00:00:00:00:04": ip("192.168.78.40"), "02:00:00:00:00:09": ip("1.1.1.1")},
        {},
    )
    ch = changes(want, have)
    assert ch.routes_set == [] and ch.routes_del == [stale]
    assert ch.fdb_set == [("02:00:00:00:00:04", ip("192.168.78.4"))] and ch.fdb_del == [
        ("02:00:00:00:00:09", ip("1.1.1.1"))
    ]
    assert len(ch.neigh_set) == 2 and ch.total() == 5


# ---------------------------------------------------------------- the subnets file


def test_subnets_file_round_trip_and_refusals(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    assert read(str(p)) is None
    p.write_bytes(NodeSubnets("n1", ("10.244.1.0/24", "fd44::/64"), 1450).dumps())
    assert read(str(p)) == NodeSubnets("n1", ("10.244.1.0/24", "fd44::/64"), 1450)
    for bad in ("{", "[]", '{"format": 2}', '{"format": 1, "node": 1, "podCIDRs": []}',
                '{"format": 1, "node": "n", "podCIDRs": ["a", "b", "c"]}',
                '{"format": 1, "node": "n", "podCIDRs": [], "mtu": 10}'):  # fmt: skip
        p.write_text(bad)
        with pytest.raises(SubnetsError, match=str(p)):
            read(str(p))


@settings(max_examples=150, deadline=None)
@given(json_values)
def test_subnets_reader_never_raises_anything_but_subnets_error(doc: Any) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(doc if not isinstance(doc, dict) else {"format": 1, **doc}, f)
        f.flush()
        try:
            got = read(f.name)
        except SubnetsError:
            return
        assert got is not None and isinstance(got.node, str) and len(got.pod_cidrs) <= 2


nets = st.builds(lambda a, p: ipaddress.ip_network((a, p), strict=False), st.integers(0, 2**32 - 1), st.integers(8, 30))


@settings(max_examples=150, deadline=None)
@given(st.lists(nets.filter(lambda n: not n.overlaps(LAN)), max_size=30))
def test_a_podcidr_overlapping_one_given_out_is_refused_naming_its_owner(
    candidates: list[ipaddress.IPv4Network],
) -> None:
    """Against the pairwise brute force: this node's networks are given out first, then each peer's in name order;
    a peer whose podCIDR overlaps one given out is not routed, naming an owner, and every other one is routed
    (the plan finds overlaps by bisection, so thousands of nodes stay linear)."""
    local = ME._replace(pod_cidrs=(net("10.244.1.0/24"),), connected=(LAN,), vtep=None, cluster=(net("0.0.0.0/0"),))
    peers = [NodeInfo(f"p{i:03d}", (c,), (ip(f"192.168.77.{10 + i}"),)) for i, c in enumerate(candidates)]
    want = desired(local, peers, "direct")
    kept: list[tuple[ipaddress.IPv4Network, str]] = [(net("10.244.1.0/24"), "n1")]
    for p in peers:
        (cidr,) = p.pod_cidrs
        owners = [who for k, who in kept if k.overlaps(cidr)]
        if not owners and trespasses(local, cidr):  # never a pod network here at all: refused for that
            assert want.unrouted[(p.name, 4)] == trespasses(local, cidr)
            continue
        if not owners:
            kept.append((cidr, p.name))  # type: ignore[arg-type]
            assert want.paths[(p.name, 4)] == "direct" and (p.name, 4) not in want.unrouted
        else:
            assert want.unrouted[(p.name, 4)] in {f"podCIDR {cidr} overlaps node {who}'s" for who in owners}
