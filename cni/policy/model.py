"""NetworkPolicies, Pods and Namespaces, as the API server sends them (hostile input), parsed into what policy
enforcement needs.

Objects arrive as lightkube's models (decoded and checked against the API's schema at the edge,
:mod:`nodeplug.kube`): the fields have their types, the values are still hostile. Nothing here raises on bad input.

**NetworkPolicy** (``networking.k8s.io/v1``) becomes a :class:`Policy`:

- ``policyTypes`` as the API server defaults it when omitted: ``Ingress``, plus ``Egress`` when ``egress`` has rules;
  a direction the policy names isolates the pods it selects in that direction (no rules: nothing allowed);
- each rule's peers (``from``/``to``; absent or empty: every source/destination) and ports (absent or empty: every
  port): a peer is an ``ipBlock`` (``cidr`` less its ``except`` networks) or a ``podSelector`` (pods of the policy's
  namespace) and/or a ``namespaceSelector`` (pods of the namespaces it selects); a port is a protocol (``TCP``
  unless named: ``TCP``, ``UDP``, ``SCTP``), a number with an optional ``endPort`` (a range), or a container
  port's name (resolved per pod), or absent (every port of the protocol).

What does not parse fails closed: a peer or port that is not valid matches nothing (a rule keeps its other peers and
ports; a rule whose every port is invalid allows nothing), and a policy whose ``podSelector`` is not valid selects
every pod of its namespace (isolating them) — each with the reason in :attr:`Policy.problems`.

**Pod** becomes a :class:`PodInfo` (labels, node, addresses, named container ports); a pod on the host network, or
one that has finished (``Succeeded``/``Failed``: its sandbox and address are gone, the address may be another
pod's), has no address of its own here. **Namespace** becomes its labels, with ``kubernetes.io/metadata.name`` as
the API server sets it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cni.policy import selector
from cni.policy.selector import EVERYTHING, NOTHING, Selector

if TYPE_CHECKING:  # types only: lightkube is loaded by whoever reads the API
    from lightkube.resources.core_v1 import Namespace, Pod
    from lightkube.resources.networking_v1 import NetworkPolicy

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Protocol = Literal["tcp", "udp", "sctp"]
Direction = Literal["ingress", "egress"]
PROTOCOLS: dict[str, Protocol] = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}
NAME_LABEL = "kubernetes.io/metadata.name"
MAX_PROBLEMS = 8
MAX_PORT_NAME = 15  # IANA_SVC_NAME


@dataclass(frozen=True)
class Port:
    """One ``ports`` entry. ``number`` None and ``name`` "" (and valid): every port of ``protocol``."""

    protocol: Protocol = "tcp"
    number: int | None = None
    end: int | None = None  # with number: the range number..end
    name: str = ""  # a container port's name, resolved per pod
    valid: bool = True

    def __str__(self) -> str:
        if not self.valid:
            return "<invalid port: matches nothing>"
        what = self.name or (f"{self.number}-{self.end}" if self.end else str(self.number or "any"))
        return f"{self.protocol}/{what}"


@dataclass(frozen=True)
class Peer:
    """Either ``block`` (the networks of ``ipBlock.cidr`` less its excepts, possibly none) or pods: those matching
    ``pods`` in the namespaces matching ``namespaces`` (None: the policy's own namespace only)."""

    block: tuple[IPNetwork, ...] | None = None
    pods: Selector = EVERYTHING
    namespaces: Selector | None = None
    text: str = ""  # as shown by the doctor

    @property
    def is_block(self) -> bool:
        return self.block is not None


@dataclass(frozen=True)
class Rule:
    peers: tuple[Peer, ...] | None  # None: every peer (anyone)
    ports: tuple[Port, ...] = ()  # empty: every port and protocol


@dataclass(frozen=True)
class Policy:
    namespace: str
    name: str
    pod_selector: Selector
    ingress: tuple[Rule, ...] | None  # None: the policy does not isolate for ingress
    egress: tuple[Rule, ...] | None
    problems: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def rules(self, direction: Direction) -> tuple[Rule, ...] | None:
        return self.ingress if direction == "ingress" else self.egress


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    node: str = ""
    ips: tuple[IPAddress, ...] = ()  # empty: no address of its own (host network, finished, not started yet)
    ports: tuple[tuple[str, Protocol, int], ...] = ()  # named container ports: (name, protocol, number)
    terminating: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def named_port(self, name: str, protocol: Protocol) -> int | None:
        return next((n for pn, pp, n in self.ports if pn == name and pp == protocol), None)


@dataclass(frozen=True)
class NamespaceInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _network(text: Any) -> IPNetwork | None:
    if not isinstance(text, str) or "/" not in text:
        return None
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        return None


def block_networks(cidr: IPNetwork, excepts: list[IPNetwork]) -> tuple[IPNetwork, ...]:
    """``cidr`` less every network of ``excepts`` (each inside it), as the fewest disjoint networks, sorted."""
    parts: list[IPNetwork] = [cidr]
    for ex in sorted(set(excepts), key=lambda n: (n.prefixlen, int(n.network_address))):
        nxt: list[IPNetwork] = []
        for p in parts:
            if ex.version != p.version or not ex.overlaps(p):
                nxt.append(p)
            elif p.subnet_of(ex):  # type: ignore[arg-type]
                continue
            else:
                nxt.extend(p.address_exclude(ex))  # type: ignore[arg-type]
        parts = nxt
    merged: list[IPNetwork] = [
        *ipaddress.collapse_addresses(n for n in parts if isinstance(n, ipaddress.IPv4Network)),
        *ipaddress.collapse_addresses(n for n in parts if isinstance(n, ipaddress.IPv6Network)),
    ]
    return tuple(sorted(merged, key=lambda n: (n.version, int(n.network_address))))


def _peer(raw: Any, where: str, problems: list[str]) -> Peer:
    block = getattr(raw, "ipBlock", None)
    pod_sel = getattr(raw, "podSelector", None)
    ns_sel = getattr(raw, "namespaceSelector", None)
    if block is not None:
        if pod_sel is not None or ns_sel is not None:
            problems.append(f"{where}: ipBlock with a selector: matches nothing")
            return Peer(block=(), text="<invalid>")
        cidr = _network(getattr(block, "cidr", None))
        if cidr is None:
            problems.append(f"{where}.ipBlock.cidr: expected a network like 10.0.0.0/8, got {_show(block.cidr)}")
            return Peer(block=(), text="<invalid>")
        excepts: list[IPNetwork] = []
        for i, text in enumerate(getattr(block, "except_", None) or ()):
            ex = _network(text)
            if ex is None or ex.version != cidr.version or not ex.subnet_of(cidr):  # type: ignore[arg-type]
                problems.append(f"{where}.ipBlock.except[{i}]: expected a network inside {cidr}, got {_show(text)}")
                return Peer(block=(), text="<invalid>")
            excepts.append(ex)
        text = str(cidr) + (f" except {','.join(map(str, sorted(set(excepts), key=str)))}" if excepts else "")
        return Peer(block=block_networks(cidr, excepts), text=text)
    if pod_sel is None and ns_sel is None:
        problems.append(f"{where}: a peer names neither ipBlock nor a selector: matches nothing")
        return Peer(pods=NOTHING, text="<invalid>")
    pods = selector.parse(pod_sel) if pod_sel is not None else EVERYTHING
    namespaces = selector.parse(ns_sel) if ns_sel is not None else None
    for s, what in ((pods, "podSelector"), (namespaces, "namespaceSelector")):
        if s is not None and not s.valid:
            problems.append(f"{where}.{what}: {s.error}: matches nothing")
    text = f"pods {pods}" + (f" in namespaces {namespaces}" if namespaces is not None else "")
    return Peer(pods=pods, namespaces=namespaces, text=text)


def _port(raw: Any, where: str, problems: list[str]) -> Port:
    proto_text = getattr(raw, "protocol", None) or "TCP"
    proto = PROTOCOLS.get(proto_text) if isinstance(proto_text, str) else None
    if proto is None:
        problems.append(f"{where}.protocol: expected TCP, UDP or SCTP, got {_show(proto_text)}: matches nothing")
        return Port(valid=False)
    port, end = getattr(raw, "port", None), getattr(raw, "endPort", None)
    if port is None:
        if end is not None:
            problems.append(f"{where}.endPort: needs a numeric port: matches nothing")
            return Port(proto, valid=False)
        return Port(proto)
    if isinstance(port, bool):
        port = None
    if isinstance(port, str) and port.isdigit():  # IntOrString as a decimal string
        port = int(port)
    if isinstance(port, int):
        if not 1 <= port <= 65535:
            problems.append(f"{where}.port: expected 1-65535, got {port}: matches nothing")
            return Port(proto, valid=False)
        if end is not None and (isinstance(end, bool) or not isinstance(end, int) or not port <= end <= 65535):
            problems.append(f"{where}.endPort: expected {port}-65535, got {_show(end)}: matches nothing")
            return Port(proto, valid=False)
        return Port(proto, port, end if end != port else None)
    if isinstance(port, str) and 0 < len(port) <= MAX_PORT_NAME and end is None:
        return Port(proto, name=port)
    problems.append(f"{where}.port: expected a number or a container port's name, got {_show(port)}: matches nothing")
    return Port(proto, valid=False)


def _rules(raw: Any, direction: Direction, problems: list[str]) -> tuple[Rule, ...]:
    rules = []
    for i, r in enumerate(raw or ()):
        where = f"spec.{direction}[{i}]"
        peers_raw = getattr(r, "from_" if direction == "ingress" else "to", None)
        field_name = "from" if direction == "ingress" else "to"
        peers = tuple(_peer(p, f"{where}.{field_name}[{j}]", problems) for j, p in enumerate(peers_raw or ())) or None
        ports = tuple(_port(p, f"{where}.ports[{j}]", problems) for j, p in enumerate(getattr(r, "ports", None) or ()))
        rules.append(Rule(peers, ports))
    return tuple(rules)


def parse_policy(obj: NetworkPolicy) -> Policy | None:
    """The policy, None when it has no namespace or name (nothing can be selected by it)."""
    meta, spec = obj.metadata, obj.spec
    ns, name = (meta.namespace, meta.name) if meta is not None else (None, None)
    if not ns or not name:
        return None
    problems: list[str] = []
    if spec is None:
        problems.append("spec: missing: isolates every pod of its namespace for ingress")
        return Policy(ns, name, EVERYTHING, (), None, tuple(problems))
    pod_selector = selector.parse(spec.podSelector)
    if not pod_selector.valid:
        problems.append(f"spec.podSelector: {pod_selector.error}: selects (isolates) every pod of the namespace")
        pod_selector = EVERYTHING
    types = spec.policyTypes
    if not types:
        types = ["Ingress", *(["Egress"] if spec.egress else [])]
    unknown = [t for t in types if t not in ("Ingress", "Egress")]
    if unknown:
        problems.append(f"spec.policyTypes: expected Ingress or Egress, got {_show(unknown[0])}: ignored")
    ingress = _rules(spec.ingress, "ingress", problems) if "Ingress" in types else None
    egress = _rules(spec.egress, "egress", problems) if "Egress" in types else None
    return Policy(ns, name, pod_selector, ingress, egress, tuple(problems[:MAX_PROBLEMS]))


def _labels(raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


def parse_pod(obj: Pod) -> PodInfo | None:
    meta, spec, status = obj.metadata, obj.spec, obj.status
    ns, name = (meta.namespace, meta.name) if meta is not None else (None, None)
    if not ns or not name:
        return None
    ips: list[IPAddress] = []
    host_network = bool(spec is not None and spec.hostNetwork)
    phase = status.phase if status is not None else None
    if status is not None and not host_network and phase not in ("Succeeded", "Failed"):
        texts = [p.ip for p in status.podIPs or ()] or ([status.podIP] if status.podIP else [])
        for text in texts:
            try:
                ip = ipaddress.ip_address(text)
            except (ValueError, TypeError):
                continue
            if not (ip.is_unspecified or ip.is_loopback or ip.is_multicast) and ip not in ips:
                ips.append(ip)
    ports: list[tuple[str, Protocol, int]] = []
    for c in [*((spec.containers or ()) if spec else ()), *((spec.initContainers or ()) if spec else ())]:
        for p in c.ports or ():
            proto = PROTOCOLS.get(p.protocol or "TCP")
            if p.name and proto and isinstance(p.containerPort, int) and 1 <= p.containerPort <= 65535:
                ports.append((p.name, proto, p.containerPort))
    return PodInfo(
        namespace=ns, name=name, uid=meta.uid or "" if meta else "", labels=_labels(meta.labels if meta else None),
        node=(spec.nodeName or "") if spec is not None else "", ips=tuple(ips), ports=tuple(ports),
        terminating=bool(meta is not None and meta.deletionTimestamp is not None),
    )  # fmt: skip


def parse_namespace(obj: Namespace) -> NamespaceInfo | None:
    name = obj.metadata.name if obj.metadata is not None else None
    if not name:
        return None
    labels = _labels(obj.metadata.labels if obj.metadata is not None else None)
    labels.setdefault(NAME_LABEL, name)
    return NamespaceInfo(name, labels)


def _dict(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, dict) else {}


def slim_pod(obj: dict[str, Any]) -> dict[str, Any]:
    """What of a Pod policy enforcement reads (for the list+watch to decode instead of the whole object):
    :func:`parse_pod` gives the same for both."""
    meta, spec, status = _dict(obj.get("metadata")), _dict(obj.get("spec")), _dict(obj.get("status"))
    keep = ("name", "namespace", "uid", "resourceVersion", "labels", "deletionTimestamp")
    containers = []
    for kind in ("containers", "initContainers"):
        items = spec.get(kind)
        if isinstance(items, list):
            containers.append((kind, [{"name": _dict(c).get("name", ""), "ports": _dict(c).get("ports") or []}
                                      for c in items if isinstance(c, dict)]))  # fmt: skip
    slim_spec: dict[str, Any] = {k: spec[k] for k in ("nodeName", "hostNetwork") if k in spec}
    slim_spec.update(containers)
    slim_spec.setdefault("containers", [])
    return {
        "metadata": {k: meta[k] for k in keep if k in meta},
        "spec": slim_spec,
        "status": {k: status[k] for k in ("phase", "podIP", "podIPs") if k in status},
    }


def slim_namespace(obj: dict[str, Any]) -> dict[str, Any]:
    meta = _dict(obj.get("metadata"))
    return {"metadata": {k: meta[k] for k in ("name", "uid", "resourceVersion", "labels") if k in meta}}
