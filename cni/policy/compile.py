"""NetworkPolicy compiled to the nftables state one node needs (a :class:`~cni.policy.ruleset.Ruleset`), kept up
to date as Pods, Namespaces and NetworkPolicies change.

Enforcement is on the node of the pod it protects: ingress on the destination pod's node, egress on the source
pod's. So a node materialises only the policies that select at least one of its own pods ("active"), but their
peers are pods anywhere in the cluster. The table (``inet nodeplug-policy``), on the inet ``forward`` hook, which
routed pod traffic and (with ``bridge-nf-call-iptables``/``ip6tables``) bridged pod traffic both traverse, and on
the ``input`` hook for what a pod sends to its own node (the node's addresses, and a Service whose endpoint is a
host-network pod of this node, DNATed to the node's address before the hook)::

    chain egress  { type filter hook forward priority -1; policy accept;      # then, for the same packet:
        icmpv6 type { nd-... } accept                                          # neighbour discovery between pods
        ct state established,related accept                                   # replies, and flows let in before
        ip saddr vmap @eg4            ip6 saddr vmap @eg6 }                    # a local pod isolated for egress
    chain egress-node { type filter hook input priority -1; policy accept;    # the same, to this node itself
        ... ip saddr vmap @eg4        ip6 saddr vmap @eg6 }
    chain ingress { type filter hook forward priority 0; policy accept;
        ... ct state established,related accept
        ip daddr vmap @in4            ip6 daddr vmap @in6 }                    # a local pod isolated for ingress
    map in4 { type ipv4_addr : verdict; elements = { 10.244.1.5 : goto s<h>-in, ... } }
    chain s<h>-in { jump p<h>-in; jump p<h'>-in;                               # the union of the pod's policies
                    counter name drop-in-<ns> drop }
    chain p<h>-in {                                                            # one policy, one direction
        ip saddr @g<h>-4 meta l4proto tcp th dport { 80, 8000-8100 } accept    # a rule: peers x ports
        ip saddr @b<h>-4 ip daddr . meta l4proto . th dport @n<h>-4 accept }   # ipBlock less except; named port

A base chain is in the table only while a pod of this node is isolated in its direction (``egress-node`` with
``egress``): a node where no policy selects a local pod has no hook of this table in its packets' path, which costs
routed pods 7-8% of their throughput otherwise (the two forward chains each look at every forwarded packet). It comes
with the first policy that isolates a local pod, in the same transaction as its map entries; a connection open
before it goes on (its packets are ``established``), as it does through any policy change. For that the kernel must
have tracked the connection while nothing was hooked: a chain on no hook (``conntrack``, never jumped to) holds a rule
that reads conntrack, which is what keeps conntrack on in a netns where nothing else (masquerade, kube-proxy) does.

A packet is looked up by address in one verdict map per direction (a hash: its cost does not grow with the number of
pods), then walks only the rules of the policies that select its pod; peers are sets of addresses (pods, and
``ipBlock`` networks less their excepts as interval sets) and named ports sets of ``address . protocol . port``
(resolved per pod: for ingress on the protected pod, for egress on the destination pod). An ``accept`` ends this
base chain only, so a packet between two pods of this node passes the source's egress and then the destination's
ingress; a drop is final. Traffic from the node itself to its pods never takes the forward hook (kubelet's probes
pass), and replies to allowed connections are ``established``. A pod isolated for egress reaches its own node only
where its policies allow the node's address (an ``ipBlock``), as it reaches any other node; there is no pod of
the node on the input hook to isolate for ingress: the node's own traffic is never filtered.

Sets are named by a hash of what they hold the definition of (the peers of a rule and their namespace, the ipBlock
networks), so policies with the same peers share one set, and a changed definition is a new set, never an old one
changed in type. Element sets are kept and shared between passes: a Pod's change touches only the sets it is (or
was) a member of; a policy's change rebuilds only its chains and the sets of its rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cni.policy.model import (
    NAME_LABEL,
    Direction,
    IPAddress,
    IPNetwork,
    NamespaceInfo,
    PodInfo,
    Policy,
    Port,
    Protocol,
    Rule,
)
from cni.policy.ruleset import Chain, Ruleset, SetSpec
from cni.policy.selector import Selector

DIRECTIONS: tuple[Direction, ...] = ("ingress", "egress")
SHORT = {"ingress": "in", "egress": "eg"}
FAMILIES = (4, 6)
FAM = {4: "ip", 6: "ip6"}
ADDR = {4: "ipv4_addr", 6: "ipv6_addr"}
ND = "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit, nd-router-advert, nd-redirect } accept"
HOOKS = {
    "egress": "type filter hook forward priority -1; policy accept;",
    "ingress": "type filter hook forward priority 0; policy accept;",
}
TO_NODE = "egress-node"  # egress to this node's own addresses: the input hook, the egress maps
TO_NODE_HOOK = "type filter hook input priority -1; policy accept;"
BASE_CHAINS = (*DIRECTIONS, TO_NODE)
# On no hook, never jumped to: a rule that reads conntrack keeps the kernel tracking this netns's flows while no
# base chain is hooked, so a flow opened then is "established" once a pod becomes isolated, and goes on.
TRACKING = "conntrack"


@dataclass(frozen=True)
class DropLog:
    """Log dropped packets (kernel log, prefix ``nodeplug-policy``) at most ``rate`` per second per namespace."""

    rate: int = 5
    burst: int = 10


def h(*parts: object) -> str:
    return hashlib.blake2s(repr(parts).encode(), digest_size=5).hexdigest()


def policy_id(key: str) -> str:
    return "p" + h(key)


def _safe(text: str) -> str:
    return "".join(c for c in text if c.isalnum() or c in ".-")[:63]


GroupKey = tuple[str, tuple[tuple[Selector, Selector | None], ...]]


class _Group:
    """The pods a rule's pod peers select, anywhere in the cluster, and their addresses."""

    def __init__(self, key: GroupKey) -> None:
        self.key = key
        self.name = "g" + h(key)
        self.uses_namespaces = any(ns is not None for _, ns in key[1])
        self.pods: set[str] = set()
        self.addrs: dict[int, frozenset[str]] = {4: frozenset(), 6: frozenset()}

    def matches(self, pod: PodInfo, ns_labels: Mapping[str, str]) -> bool:
        if not pod.ips:
            return False
        for pods, namespaces in self.key[1]:
            if namespaces is None:
                if pod.namespace != self.key[0]:
                    continue
            elif not namespaces.matches(ns_labels):
                continue
            if pods.matches(pod.labels):
                return True
        return False


def _group_key(policy: Policy, rule: Rule) -> GroupKey | None:
    peers = [p for p in rule.peers or () if not p.is_block]
    if not peers:
        return None
    uses_own_ns = any(p.namespaces is None for p in peers)
    ns = policy.namespace if uses_own_ns else ""
    return ns, tuple(sorted({(p.pods, p.namespaces) for p in peers}, key=str))


def _blocks(rule: Rule, version: int) -> tuple[IPNetwork, ...]:
    nets = {n for p in rule.peers or () if p.block is not None for n in p.block if n.version == version}
    return tuple(sorted(nets, key=lambda n: (int(n.network_address), n.prefixlen)))


def _numeric_clauses(ports: Iterable[Port]) -> list[str]:
    by_proto: dict[str, list[str]] = {}
    any_port: list[str] = []
    for p in ports:
        if not p.valid or p.name:
            continue
        if p.number is None:
            any_port.append(p.protocol)
        else:
            by_proto.setdefault(p.protocol, []).append(f"{p.number}-{p.end}" if p.end else str(p.number))
    out = [f"meta l4proto {proto}" for proto in dict.fromkeys(any_port)]
    for proto, nums in by_proto.items():
        if proto not in any_port:
            out.append(f"meta l4proto {proto} th dport {{ {', '.join(dict.fromkeys(nums))} }}")
    return out


class Compiler:
    """The cluster's state as this node has seen it, and the ruleset it asks for (:meth:`ruleset`)."""

    def __init__(self, node: str, drop_log: DropLog | None = None) -> None:
        self.node = node
        self.drop_log = drop_log
        self.policies: dict[str, Policy] = {}
        self.ns_policies: dict[str, dict[str, Policy]] = {}
        self.pods: dict[str, PodInfo] = {}
        self.ns_pods: dict[str, set[str]] = {}
        self.namespaces: dict[str, NamespaceInfo] = {}
        self.named: dict[tuple[str, str], set[str]] = {}  # (port name, protocol) -> pods with such a port
        self._groups: dict[GroupKey, _Group] = {}
        self._chains: dict[tuple[str, Direction], tuple[Policy, Chain, dict[str, SetSpec], dict[str, frozenset[str]]]]
        self._chains = {}

    # ------------------------------------------------------------ the cluster's state

    def ns_labels(self, ns: str) -> Mapping[str, str]:
        info = self.namespaces.get(ns)
        return info.labels if info is not None else {NAME_LABEL: ns}

    def set_policy(self, key: str, policy: Policy | None) -> None:
        old = self.policies.pop(key, None)
        if old is not None:
            self.ns_policies.get(old.namespace, {}).pop(key, None)
        if policy is not None:
            self.policies[key] = policy
            self.ns_policies.setdefault(policy.namespace, {})[key] = policy

    def set_namespace(self, name: str, info: NamespaceInfo | None) -> None:
        old = self.namespaces.pop(name, None)
        if info is not None:
            self.namespaces[name] = info
        if (old.labels if old else None) != (info.labels if info else None):
            for key in [k for k, g in self._groups.items() if g.uses_namespaces]:
                del self._groups[key]  # made again from every pod when next used

    def set_pod(self, key: str, pod: PodInfo | None) -> None:
        old = self.pods.pop(key, None)
        if old is not None:
            self.ns_pods.get(old.namespace, set()).discard(key)
            for name, proto, _ in old.ports:
                self.named.get((name, proto), set()).discard(key)
        if pod is not None:
            self.pods[key] = pod
            self.ns_pods.setdefault(pod.namespace, set()).add(key)
            for name, proto, _ in pod.ports:
                self.named.setdefault((name, proto), set()).add(key)
        for g in self._groups.values():
            was = key in g.pods
            now = pod is not None and g.matches(pod, self.ns_labels(pod.namespace))
            if now:
                g.pods.add(key)
            else:
                g.pods.discard(key)
            if was or now:
                self._addresses(g)

    def _addresses(self, g: _Group) -> None:
        for v in FAMILIES:
            g.addrs[v] = frozenset(str(a) for k in g.pods for a in self.pods[k].ips if a.version == v)

    def _group(self, key: GroupKey) -> _Group:
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(key)
            for pk, pod in self.pods.items():
                if g.matches(pod, self.ns_labels(pod.namespace)):
                    g.pods.add(pk)
            self._addresses(g)
        return g

    # ------------------------------------------------------------ what selects what

    def local_pods(self) -> list[PodInfo]:
        return [p for p in self.pods.values() if p.node == self.node and p.ips]

    def selecting(self, pod: PodInfo, direction: Direction) -> list[Policy]:
        """The policies isolating ``pod`` in ``direction``, by key."""
        return sorted(
            (p for p in self.ns_policies.get(pod.namespace, {}).values()
             if p.rules(direction) is not None and p.pod_selector.matches(pod.labels)),
            key=lambda p: p.key,
        )  # fmt: skip

    def peers_of(self, policy: Policy, rule: Rule) -> list[PodInfo]:
        """The pods a rule's pod peers select (for the doctor)."""
        key = _group_key(policy, rule)
        return [] if key is None else [self.pods[k] for k in sorted(self._group(key).pods)]

    # ------------------------------------------------------------ the ruleset

    def ruleset(self) -> Ruleset:
        want = Ruleset()
        targets: dict[tuple[str, Direction], list[PodInfo]] = {}
        selection: dict[Direction, dict[str, str]] = {d: {} for d in DIRECTIONS}
        chain_ns: dict[str, str] = {}
        for pod in self.local_pods():
            for d in DIRECTIONS:
                pols = self.selecting(pod, d)
                if not pols:
                    continue
                for p in pols:
                    targets.setdefault((p.key, d), []).append(pod)
                ids = tuple(policy_id(p.key) for p in pols)
                sname = f"s{h(ids)}-{SHORT[d]}"
                chain_ns[sname] = pod.namespace
                for a in pod.ips:
                    selection[d][str(a)] = sname
                want.chains.setdefault(sname, self._selection_chain(ids, d, pod.namespace))
        used_groups: set[GroupKey] = set()
        for (key, d), pods in sorted(targets.items(), key=lambda kv: kv[0]):
            policy = self.policies[key]
            chain, sets, elements = self._policy_chain(policy, d, used_groups)
            want.chains[f"{policy_id(key)}-{SHORT[d]}"] = chain
            want.sets.update(sets)
            want.elements.update(elements)
            self._ingress_named(policy, d, pods, want)
        for gone in set(self._groups) - used_groups:
            del self._groups[gone]
        for d in DIRECTIONS:
            if selection[d]:  # hooked only while a pod of this node is isolated this way: else no cost per packet
                want.chains[d] = self._base_chain(d)
            for v in FAMILIES:
                name = f"{SHORT[d]}{v}"
                want.sets[name] = SetSpec(ADDR[v], value="verdict")
                want.maps[name] = {a: f"goto {c}" for a, c in selection[d].items() if (":" in a) == (v == 6)}
        if "egress" in want.chains:
            want.chains[TO_NODE] = Chain(want.chains["egress"].rules, TO_NODE_HOOK)
        want.chains[TRACKING] = Chain(("ct state established,related accept",))
        want.counters = frozenset(f"drop-{SHORT[d]}-{h(ns)}" for d in DIRECTIONS for ns in set(chain_ns.values()))
        want.counters = frozenset(
            c for c in want.counters if any(r.endswith(f"{c} drop") for ch in want.chains.values() for r in ch.rules)
        )
        return want

    def _base_chain(self, d: Direction) -> Chain:
        addr = "saddr" if d == "egress" else "daddr"
        return Chain(
            (ND, "ct state established,related accept", f"ip {addr} vmap @{SHORT[d]}4",
             f"ip6 {addr} vmap @{SHORT[d]}6"),
            HOOKS[d],
        )  # fmt: skip

    def _selection_chain(self, ids: tuple[str, ...], d: Direction, ns: str) -> Chain:
        rules = [f"jump {i}-{SHORT[d]}" for i in ids]
        if self.drop_log is not None:
            prefix = f"nodeplug-policy {d} drop {_safe(ns)}: "
            rules.append(f'limit rate {self.drop_log.rate}/second burst {self.drop_log.burst} packets '
                         f'log prefix "{prefix}" level info')  # fmt: skip
        rules.append(f"counter name drop-{SHORT[d]}-{h(ns)} drop")
        return Chain(tuple(rules))

    def _policy_chain(
        self, policy: Policy, d: Direction, used_groups: set[GroupKey]
    ) -> tuple[Chain, dict[str, SetSpec], dict[str, frozenset[str]]]:
        """The chain of one policy in one direction, with the sets its rules refer to (the egress named-port sets
        and the ingress ones are made elsewhere: they depend on pods)."""
        rules = policy.rules(d) or ()
        sets: dict[str, SetSpec] = {}
        elements: dict[str, frozenset[str]] = {}
        lines: list[str] = []
        addr = "saddr" if d == "ingress" else "daddr"
        for i, rule in enumerate(rules):
            gkey = _group_key(policy, rule)
            group = self._group(gkey) if gkey is not None else None
            if gkey is not None and group is not None:
                used_groups.add(gkey)
            numeric = _numeric_clauses(rule.ports)
            names = sorted({(p.name, p.protocol) for p in rule.ports if p.valid and p.name})
            if rule.ports and not numeric and not names:
                continue  # every port invalid: allows nothing
            for v in FAMILIES:
                peers: list[str] = []
                if rule.peers is None:
                    peers.append("")
                if group is not None:
                    sets[f"{group.name}-{v}"] = SetSpec(ADDR[v])
                    elements[f"{group.name}-{v}"] = group.addrs[v]
                    peers.append(f"{FAM[v]} {addr} @{group.name}-{v}")
                blocks = _blocks(rule, v)
                if blocks:
                    bname = f"b{h(blocks)}-{v}"
                    sets[bname] = SetSpec(ADDR[v], interval=True)
                    elements[bname] = frozenset(map(str, blocks))
                    peers.append(f"{FAM[v]} {addr} @{bname}")
                ports = list(numeric) if rule.ports else [""]
                if names:
                    nname = self._named_set_name(policy, d, i, v)
                    sets[nname] = SetSpec(f"{ADDR[v]} . inet_proto . inet_service")
                    if d == "egress":
                        elements[nname] = self._egress_named(rule, names, group, v)
                    ports.append(f"{FAM[v]} daddr . meta l4proto . th dport @{nname}")
                for peer in peers:
                    for port in ports:
                        lines.append(" ".join(x for x in (peer, port, "accept") if x))
        return Chain(tuple(dict.fromkeys(lines))), sets, elements

    @staticmethod
    def _named_set_name(policy: Policy, d: Direction, i: int, v: int) -> str:
        return f"n{h(policy.key, d, i)}-{v}"

    def _egress_named(
        self, rule: Rule, names: list[tuple[str, Protocol]], group: _Group | None, v: int
    ) -> frozenset[str]:
        """``address . protocol . port`` of every destination pod the rule's peers allow, for each of its named
        ports that pod has."""
        blocks = _blocks(rule, v)
        out: set[str] = set()
        for name, proto in names:
            for pk in self.named.get((name, proto), ()):
                pod = self.pods[pk]
                number = pod.named_port(name, proto)
                for a in pod.ips:
                    if a.version != v or number is None:
                        continue
                    if rule.peers is None or (group is not None and pk in group.pods) or _inside(a, blocks):
                        out.add(f"{a} . {proto} . {number}")
        return frozenset(out)

    def _ingress_named(self, policy: Policy, d: Direction, targets: list[PodInfo], want: Ruleset) -> None:
        if d != "ingress":
            return
        for i, rule in enumerate(policy.ingress or ()):
            names = sorted({(p.name, p.protocol) for p in rule.ports if p.valid and p.name})
            for v in FAMILIES:
                nname = self._named_set_name(policy, d, i, v)
                if nname not in want.sets:
                    continue
                out: set[str] = set()
                for pod in targets:
                    for name, proto in names:
                        number = pod.named_port(name, proto)
                        if number is not None:
                            out.update(f"{a} . {proto} . {number}" for a in pod.ips if a.version == v)
                want.elements[nname] = frozenset(out)


def _inside(a: IPAddress, blocks: tuple[IPNetwork, ...]) -> bool:
    return any(a in n for n in blocks)
