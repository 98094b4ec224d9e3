"""NetworkPolicy's pure core: selectors, policies parsed from the API's objects (hostile input), the ruleset one
node needs, and the difference between two rulesets."""

from __future__ import annotations

import ipaddress
import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkube.models.meta_v1 import LabelSelector, LabelSelectorRequirement
from lightkube.resources.core_v1 import Namespace, Pod
from lightkube.resources.networking_v1 import NetworkPolicy

from cni.policy import selector
from cni.policy.compile import BASE_CHAINS, TRACKING, Compiler, DropLog
from cni.policy.model import (
    NAME_LABEL,
    NamespaceInfo,
    PodInfo,
    block_networks,
    parse_namespace,
    parse_pod,
    parse_policy,
    slim_pod,
)
from cni.policy.ruleset import diff_script, full_script

ip = ipaddress.ip_address
net = ipaddress.ip_network

KEYS = st.sampled_from(["app", "tier", "example.com/team", "x"])
VALUES = st.sampled_from(["a", "b", "c", ""])
LABELS = st.dictionaries(KEYS, VALUES, max_size=4)


def policy(ns: str, name: str, spec: dict[str, Any]) -> NetworkPolicy:
    return NetworkPolicy.from_dict({"metadata": {"namespace": ns, "name": name}, "spec": spec})


def pod_obj(ns: str, name: str, labels: dict[str, str], node: str, ips: list[str], ports: Any = ()) -> Pod:
    return Pod.from_dict({
        "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}", "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "ports": list(ports)}]},
        "status": {"phase": "Running", "podIPs": [{"ip": a} for a in ips], "podIP": ips[0] if ips else None},
    })  # fmt: skip


# ---------------------------------------------------------------- selectors


@st.composite
def selectors(draw: st.DrawFn) -> tuple[LabelSelector, dict[str, str], list[tuple[str, str, list[str]]]]:
    labels = draw(st.dictionaries(KEYS, VALUES, max_size=2))
    exprs = draw(st.lists(st.tuples(KEYS, st.sampled_from(selector.OPERATORS), st.lists(VALUES, max_size=2)),
                          max_size=3))  # fmt: skip
    exprs = [(k, op, vals if op in ("In", "NotIn") else []) for k, op, vals in exprs]
    exprs = [(k, op, vals or ["a"]) if op in ("In", "NotIn") else (k, op, vals) for k, op, vals in exprs]
    reqs = [LabelSelectorRequirement(key=k, operator=op, values=vals or None) for k, op, vals in exprs]
    return LabelSelector(matchLabels=labels or None, matchExpressions=reqs or None), labels, exprs


@given(selectors(), LABELS)
def test_a_selector_matches_exactly_when_every_label_and_expression_holds(sel: Any, labels: dict[str, str]) -> None:
    raw, want_labels, exprs = sel
    expected = all(labels.get(k) == v for k, v in want_labels.items())
    for k, op, vals in exprs:
        expected &= {
            "In": k in labels and labels[k] in vals,
            "NotIn": k not in labels or labels[k] not in vals,
            "Exists": k in labels,
            "DoesNotExist": k not in labels,
        }[op]
    parsed = selector.parse(raw)
    assert parsed.valid
    assert parsed.matches(labels) == expected


@given(LABELS)
def test_the_empty_selector_matches_everything_and_an_invalid_one_nothing(labels: dict[str, str]) -> None:
    assert selector.parse(LabelSelector()).matches(labels)
    for bad in (
        LabelSelector(matchExpressions=[LabelSelectorRequirement(key="app", operator="Equals", values=["a"])]),
        LabelSelector(matchExpressions=[LabelSelectorRequirement(key="app", operator="In", values=None)]),
        LabelSelector(matchExpressions=[LabelSelectorRequirement(key="app", operator="Exists", values=["a"])]),
        LabelSelector(matchExpressions=[LabelSelectorRequirement(key="", operator="Exists")]),
    ):
        parsed = selector.parse(bad)
        assert not parsed.valid and parsed.error
        assert not parsed.matches(labels)


# ---------------------------------------------------------------- ipBlock


@given(st.integers(8, 28), st.lists(st.tuples(st.integers(0, 2**24 - 1), st.integers(0, 8)), max_size=12),
       st.lists(st.integers(0, 2**32 - 1), min_size=20, max_size=20))  # fmt: skip
def test_an_ipblock_less_its_excepts_holds_exactly_the_addresses_left(
    prefix: int, excepts: list[tuple[int, int]], probes: list[int]
) -> None:
    cidr = net(f"10.0.0.0/{prefix}")
    exs = [net((int(cidr.network_address) + (off % cidr.num_addresses), min(32, prefix + extra)), strict=False)
           for off, extra in excepts]  # fmt: skip
    got = block_networks(cidr, exs)
    for a, b in itertools.pairwise(got):
        assert not a.overlaps(b)
    edges = [n.network_address for n in exs] + [n.broadcast_address for n in exs] + [cidr.network_address]
    for addr in [*edges, *(ipaddress.IPv4Address(p) for p in probes)]:
        expected = addr in cidr and not any(addr in e for e in exs)
        assert any(addr in n for n in got) == expected, addr


# ---------------------------------------------------------------- policies parsed


def test_policy_types_default_as_the_api_server_defaults_them() -> None:
    only_ingress = parse_policy(policy("a", "p", {"podSelector": {}}))
    assert only_ingress is not None and only_ingress.ingress == () and only_ingress.egress is None
    both = parse_policy(policy("a", "p", {"podSelector": {}, "egress": [{}]}))
    assert both is not None and both.ingress == () and both.egress is not None and len(both.egress) == 1
    egress_only = parse_policy(policy("a", "p", {"podSelector": {}, "policyTypes": ["Egress"]}))
    assert egress_only is not None and egress_only.ingress is None and egress_only.egress == ()


def test_ports_numbers_ranges_names_and_protocols() -> None:
    p = parse_policy(policy("a", "p", {"podSelector": {}, "ingress": [{"ports": [
        {"port": 80}, {"port": 8000, "endPort": 8100, "protocol": "UDP"}, {"port": "http"}, {"protocol": "SCTP"},
        {"port": 70000}, {"port": 90, "endPort": 80}, {"port": "http", "endPort": 90}, {"protocol": "ICMP"},
    ]}]}))  # fmt: skip
    assert p is not None and p.ingress is not None
    shown = [str(x) for x in p.ingress[0].ports]
    assert shown[:4] == ["tcp/80", "udp/8000-8100", "tcp/http", "sctp/any"]
    assert all("invalid" in s for s in shown[4:])
    assert len(p.problems) == 4


def test_a_policy_with_an_invalid_pod_selector_isolates_its_whole_namespace_and_says_why() -> None:
    p = parse_policy(policy("a", "p", {"podSelector": {"matchExpressions": [{"key": "x", "operator": "Is"}]},
                                       "ingress": [{}]}))  # fmt: skip
    assert p is not None and p.pod_selector.everything and "podSelector" in p.problems[0]


hostile_text = st.one_of(st.text(max_size=20), st.sampled_from(["10.0.0.0/8", "::/0", "1.2.3.4/33", "", "TCP"]))
hostile_peer = st.fixed_dictionaries({}, optional={
    "ipBlock": st.fixed_dictionaries({"cidr": hostile_text}, optional={"except": st.lists(hostile_text, max_size=3)}),
    "podSelector": st.fixed_dictionaries({}, optional={"matchLabels": st.dictionaries(hostile_text, hostile_text)}),
    "namespaceSelector": st.fixed_dictionaries({}, optional={"matchExpressions": st.lists(st.fixed_dictionaries(
        {"key": hostile_text, "operator": hostile_text}, optional={"values": st.lists(hostile_text)}), max_size=2)}),
})  # fmt: skip
hostile_port = st.fixed_dictionaries({}, optional={
    "port": st.one_of(st.integers(-5, 70000), hostile_text), "endPort": st.integers(-5, 70000),
    "protocol": hostile_text})  # fmt: skip
hostile_rule = st.fixed_dictionaries({}, optional={"from": st.lists(hostile_peer, max_size=3),
                                                   "to": st.lists(hostile_peer, max_size=3),
                                                   "ports": st.lists(hostile_port, max_size=3)})  # fmt: skip


@settings(max_examples=300)
@given(st.fixed_dictionaries({}, optional={
    "podSelector": st.fixed_dictionaries({}, optional={"matchLabels": st.dictionaries(hostile_text, hostile_text)}),
    "policyTypes": st.lists(hostile_text, max_size=3), "ingress": st.lists(hostile_rule, max_size=3),
    "egress": st.lists(hostile_rule, max_size=3)}))  # fmt: skip
def test_any_policy_the_schema_admits_compiles_to_a_ruleset_that_parses(spec: dict[str, Any]) -> None:
    try:
        obj = policy("a", "p", spec)
    except (msgspec.ValidationError, TypeError, ValueError):
        return  # not of the kind's schema: the watch never hands it on
    parsed = parse_policy(obj)
    assert parsed is not None
    c = Compiler("n1")
    c.set_pod("a/x", PodInfo("a", "x", labels={}, node="n1", ips=(ip("10.1.0.2"), ip("fd01::2"))))
    c.set_policy(parsed.key, parsed)
    want = c.ruleset()
    assert_consistent(want)
    for rules in (parsed.ingress, parsed.egress):
        for rule in rules or ():
            for peer in rule.peers or ():
                if peer.block:
                    assert all(n.version in (4, 6) for n in peer.block)


def assert_consistent(want: Any) -> None:
    """Every set, map, chain and counter a rule or map entry names exists; every chain is reachable."""
    referenced: set[str] = set()
    for ch in want.chains.values():
        for r in ch.rules:
            words = r.split()
            for i, w in enumerate(words):
                if w.startswith("@"):
                    assert w[1:] in want.sets, r
                if w in ("jump", "goto"):
                    assert words[i + 1] in want.chains, r
                    referenced.add(words[i + 1])
                if w == "name" and words[i - 1] == "counter":
                    assert words[i + 1] in want.counters, r
            assert "\n" not in r
    for m in want.maps.values():
        for verdict in m.values():
            assert verdict.split()[1] in want.chains
            referenced.add(verdict.split()[1])
    assert set(want.chains) - referenced == (set(BASE_CHAINS) & set(want.chains)) | {TRACKING}
    assert not want.chains[TRACKING].hook
    for d, short in (("ingress", "in"), ("egress", "eg")):  # a direction's hook is there iff a local pod is isolated
        assert (d in want.chains) == any(want.maps[f"{short}{v}"] for v in (4, 6))
    assert ("egress-node" in want.chains) == ("egress" in want.chains)
    assert set(want.elements) <= set(want.sets)


def test_pods_namespaces_and_their_slim_forms_parse_the_same() -> None:
    raw = {"metadata": {"namespace": "a", "name": "p", "uid": "u", "labels": {"app": "web"}, "annotations": {"x": "y"}},
           "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i", "ports": [
               {"name": "http", "containerPort": 8080}, {"name": "dns", "containerPort": 53, "protocol": "UDP"},
               {"containerPort": 9}]}]},
           "status": {"phase": "Running", "podIP": "10.1.0.5", "podIPs": [{"ip": "10.1.0.5"}, {"ip": "fd01::5"}],
                      "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    full, slim = parse_pod(Pod.from_dict(raw)), parse_pod(Pod.from_dict(slim_pod(raw)))
    assert full == slim
    assert full is not None and full.ips == (ip("10.1.0.5"), ip("fd01::5"))
    assert full.named_port("http", "tcp") == 8080 and full.named_port("dns", "udp") == 53
    assert full.named_port("dns", "tcp") is None
    done = parse_pod(Pod.from_dict({**raw, "status": {**raw["status"], "phase": "Succeeded"}}))
    assert done is not None and done.ips == ()  # its address may already be another pod's
    host = parse_pod(Pod.from_dict({**raw, "spec": {**raw["spec"], "hostNetwork": True}}))
    assert host is not None and host.ips == ()
    ns = parse_namespace(Namespace.from_dict({"metadata": {"name": "a", "labels": {"team": "x"}}}))
    assert ns == NamespaceInfo("a", {"team": "x", NAME_LABEL: "a"})


# ---------------------------------------------------------------- the ruleset


def compiler_with(*policies: NetworkPolicy, pods: list[Pod], namespaces: dict[str, dict[str, str]]) -> Compiler:
    c = Compiler("n1")
    for name, labels in namespaces.items():
        c.set_namespace(name, parse_namespace(Namespace.from_dict({"metadata": {"name": name, "labels": labels}})))
    for p in pods:
        info = parse_pod(p)
        assert info is not None
        c.set_pod(info.key, info)
    for pol in policies:
        parsed = parse_policy(pol)
        assert parsed is not None
        c.set_policy(parsed.key, parsed)
    return c


def test_a_pod_no_policy_selects_is_open_and_a_policy_with_no_local_pod_is_not_materialised() -> None:
    c = compiler_with(
        policy("a", "deny", {"podSelector": {"matchLabels": {"app": "db"}}}),
        pods=[pod_obj("a", "web", {"app": "web"}, "n1", ["10.1.0.2"]),
              pod_obj("a", "db", {"app": "db"}, "n2", ["10.2.0.2"])],
        namespaces={"a": {}},
    )  # fmt: skip
    want = c.ruleset()
    assert all(not m for m in want.maps.values())
    assert set(want.chains) == {TRACKING}  # nothing to enforce here: no hook in the packets' path at all
    assert "hook" not in full_script(want)


def test_a_direction_is_hooked_only_while_a_local_pod_is_isolated_that_way() -> None:
    pods = [
        pod_obj("a", "web", {"app": "web"}, "n1", ["10.1.0.2"]),
        pod_obj("a", "db", {"app": "db"}, "n1", ["10.1.0.3"]),
    ]
    c = compiler_with(pods=pods, namespaces={"a": {}})
    empty = c.ruleset()
    parsed = parse_policy(
        policy("a", "db", {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"]})
    )
    assert parsed is not None
    c.set_policy(parsed.key, parsed)
    isolated = c.ruleset()
    assert {n for n, ch in isolated.chains.items() if ch.hook} == {"ingress"}
    up = diff_script(empty, isolated)
    assert "add chain inet nodeplug-policy ingress { type filter hook forward priority 0; policy accept; }" in up
    assert "egress" not in up
    c.set_policy(parsed.key, None)
    down = diff_script(isolated, c.ruleset())
    assert "delete chain inet nodeplug-policy ingress\n" in down and "hook" not in down


def test_named_ports_are_resolved_per_protected_pod() -> None:
    c = compiler_with(
        policy("a", "http", {"podSelector": {}, "ingress": [{"ports": [{"port": "http"}]}]}),
        pods=[pod_obj("a", "one", {}, "n1", ["10.1.0.2"], [{"name": "http", "containerPort": 8080}]),
              pod_obj("a", "two", {}, "n1", ["10.1.0.3", "fd01::3"], [{"name": "http", "containerPort": 9090}]),
              pod_obj("a", "three", {}, "n1", ["10.1.0.4"], [{"name": "other", "containerPort": 80}])],
        namespaces={"a": {}},
    )  # fmt: skip
    want = c.ruleset()
    named = {k: v for k, v in want.elements.items() if k.startswith("n")}
    assert sorted(named.values(), key=len) == [
        frozenset({"fd01::3 . tcp . 9090"}),
        frozenset({"10.1.0.2 . tcp . 8080", "10.1.0.3 . tcp . 9090"}),
    ]
    assert set(want.maps["in4"]) == {"10.1.0.2", "10.1.0.3", "10.1.0.4"}  # three is isolated: nothing allowed


def test_drop_logging_is_rate_limited_per_namespace_when_asked() -> None:
    c = compiler_with(policy("a", "deny", {"podSelector": {}}), pods=[pod_obj("a", "x", {}, "n1", ["10.1.0.2"])],
                      namespaces={"a": {}})  # fmt: skip
    assert not any("log" in r for ch in c.ruleset().chains.values() for r in ch.rules)
    c.drop_log = DropLog(rate=3)
    c.set_policy("a/deny", None)
    c.ruleset()
    c.set_policy("a/deny", parse_policy(policy("a", "deny", {"podSelector": {}})))
    logs = [r for ch in c.ruleset().chains.values() for r in ch.rules if " log " in r]
    assert logs == ['limit rate 3/second burst 10 packets log prefix "nodeplug-policy ingress drop a: " level info']


# ---------------------------------------------------------------- incremental = from scratch, and the diff

NODES = ["n1", "n2"]
event = st.one_of(
    st.tuples(st.just("pod"), st.integers(0, 5), st.sampled_from(["a", "b"]), LABELS, st.sampled_from(NODES),
              st.booleans(), st.sampled_from([8080, 9090])),
    st.tuples(st.just("pod-gone"), st.integers(0, 5)),
    st.tuples(st.just("ns"), st.sampled_from(["a", "b"]), LABELS),
    st.tuples(st.just("policy"), st.integers(0, 3), st.sampled_from(["a", "b"]), LABELS, LABELS, LABELS,
              st.sampled_from([None, "10.9.0.0/16"]), st.booleans()),
    st.tuples(st.just("policy-gone"), st.integers(0, 3)),
)  # fmt: skip


def apply_event(c: Compiler, ev: tuple[Any, ...]) -> None:
    if ev[0] == "pod":
        _, i, ns, labels, node, has_ip, port = ev
        ips = [f"10.{NODES.index(node) + 1}.0.{i + 2}", f"fd0{NODES.index(node) + 1}::{i + 2}"] if has_ip else []
        info = parse_pod(pod_obj(ns, f"pod{i}", labels, node, ips, [{"name": "http", "containerPort": port}]))
        for key in [k for k in c.pods if k.endswith(f"/pod{i}")]:
            c.set_pod(key, None)
        assert info is not None
        c.set_pod(info.key, info)
    elif ev[0] == "pod-gone":
        for key in [k for k in c.pods if k.endswith(f"/pod{ev[1]}")]:
            c.set_pod(key, None)
    elif ev[0] == "ns":
        c.set_namespace(ev[1], parse_namespace(Namespace.from_dict({"metadata": {"name": ev[1], "labels": ev[2]}})))
    elif ev[0] == "policy":
        _, i, ns, target, peers, nsel, block, egress = ev
        rule: dict[str, Any] = {"from": [{"podSelector": {"matchLabels": peers}},
                                         {"namespaceSelector": {"matchLabels": nsel}}],
                                "ports": [{"port": "http"}, {"port": 53, "protocol": "UDP"}]}  # fmt: skip
        if block:
            rule["from"].append({"ipBlock": {"cidr": block, "except": ["10.9.1.0/24"]}})
        spec: dict[str, Any] = {"podSelector": {"matchLabels": target}, "ingress": [rule]}
        if egress:
            spec["egress"] = [{"to": rule["from"], "ports": rule["ports"]}]
        for key in [k for k in c.policies if k.endswith(f"/pol{i}")]:
            c.set_policy(key, None)
        parsed = parse_policy(policy(ns, f"pol{i}", spec))
        assert parsed is not None
        c.set_policy(parsed.key, parsed)
    else:
        for key in [k for k in c.policies if k.endswith(f"/pol{ev[1]}")]:
            c.set_policy(key, None)


@settings(max_examples=200, deadline=None)
@given(st.lists(event, max_size=25))
def test_the_ruleset_kept_up_to_date_event_by_event_is_the_one_made_from_scratch(events: list[Any]) -> None:
    kept = Compiler("n1")
    rulesets = [kept.ruleset()]
    for ev in events:
        apply_event(kept, ev)
        rulesets.append(kept.ruleset())
    fresh = Compiler("n1")
    for name, info in kept.namespaces.items():
        fresh.set_namespace(name, info)
    for key, pol in kept.policies.items():
        fresh.set_policy(key, pol)
    for key, pod in kept.pods.items():
        fresh.set_pod(key, pod)
    assert fresh.ruleset() == rulesets[-1]
    assert_consistent(rulesets[-1])
    assert diff_script(rulesets[-1], rulesets[-1]) == ""
    # every difference names only what changed: no line for a set or chain both rulesets hold unchanged
    for before, after in itertools.pairwise(rulesets):
        script = diff_script(before, after)
        for name in set(before.chains) & set(after.chains):
            if before.chains[name] == after.chains[name]:
                touched = [line for line in script.splitlines() if line.split()[3:4] == [name]
                           or line.split()[4:5] == [name]]  # fmt: skip
                assert touched == [], touched


@pytest.mark.parametrize("count", [0, 1, 4500])
def test_large_sets_are_written_in_chunks(count: int) -> None:
    c = Compiler("n1")
    spec = {"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}]}]}
    c.set_policy("a/p", parse_policy(policy("a", "p", spec)))
    for i in range(count):
        c.set_pod(f"a/p{i}", PodInfo("a", f"p{i}", node="n2", ips=(ip(int(ip("10.2.0.0")) + i),)))
    c.set_pod("a/me", PodInfo("a", "me", node="n1", ips=(ip("10.1.0.2"),)))
    script = full_script(c.ruleset())
    lines = [line for line in script.splitlines() if line.startswith("add element") and "-4 {" in line]
    assert sum(line.count(",") + 1 for line in lines if line.split()[4].startswith("g")) == count + 1
    assert all(line.count(",") < 2000 for line in lines)
