"""Node objects, as the API server sends them (hostile input), parsed into what the cluster network needs.

A Node arrives as lightkube's model (``lightkube.resources.core_v1.Node``), decoded and checked against the API's
schema at the edge (:mod:`nodeplug.kube`): its fields have their types, its values are still hostile. It is read for:

- ``spec.podCIDRs`` (``spec.podCIDR`` on its own when the list is absent): at most one network per address family,
  host bits zero, not a host route;
- ``status.addresses`` of type ``InternalIP``, in their order: the underlay addresses (the first of each family);
- annotations ``nodeplug.io/vtep-mac`` and ``nodeplug.io/vtep-address``: where the node's agent terminates VXLAN.

Nothing here raises on bad input: a field that does not parse is left out and named in :attr:`NodeInfo.problems`
(logged by the agent, shown by the doctor), so one bad Node never stops the others from being routed.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # types only: lightkube is loaded by whoever reads Nodes from the API
    from lightkube.resources.core_v1 import Node

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

ANNOTATION_PREFIX = "nodeplug.io/"
VTEP_MAC = ANNOTATION_PREFIX + "vtep-mac"
VTEP_ADDRESS = ANNOTATION_PREFIX + "vtep-address"
NETWORK_UNAVAILABLE = "NetworkUnavailable"
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
MAX_PROBLEMS = 8


class Vtep(NamedTuple):
    mac: str  # lower case, colon separated, unicast
    address: IPAddress  # the underlay address its VXLAN packets come from


class NodeInfo(NamedTuple):
    name: str
    pod_cidrs: tuple[IPNetwork, ...] = ()  # at most one per family, in the Node's order
    internal_ips: tuple[IPAddress, ...] = ()
    vtep: Vtep | None = None
    problems: tuple[str, ...] = ()

    def pod_cidr(self, version: int) -> IPNetwork | None:
        return next((c for c in self.pod_cidrs if c.version == version), None)

    def internal_ip(self, version: int) -> IPAddress | None:
        return next((a for a in self.internal_ips if a.version == version), None)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dict(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, dict) else {}


def parse_mac(text: Any) -> str | None:
    """A unicast MAC address in canonical form, or None."""
    if not isinstance(text, str):
        return None
    mac = text.strip().lower().replace("-", ":")
    if not _MAC.match(mac):
        return None
    first = int(mac[:2], 16)
    if first & 1 or mac == "00:00:00:00:00:00":  # multicast/broadcast, or zero
        return None
    return mac


def _address(text: Any) -> IPAddress | None:
    if not isinstance(text, str):
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _usable(ip: IPAddress) -> bool:
    return not (ip.is_unspecified or ip.is_multicast or ip.is_loopback or ip.is_link_local)


def parse_node(node: Node) -> NodeInfo | None:
    """The parts of a Node the network uses; None when it has no name."""
    meta, spec, status = node.metadata, node.spec, node.status
    name = meta.name if meta is not None else None
    if not name or len(name) > 253:
        return None
    problems: list[str] = []

    raw = spec.podCIDRs if spec is not None else None
    if raw is None and spec is not None and spec.podCIDR:
        raw = [spec.podCIDR]
    cidrs: list[IPNetwork] = []
    for i, text in enumerate(raw or []):
        try:
            net = ipaddress.ip_network(text, strict=True)
        except ValueError:
            net = None
        if net is None or net.prefixlen > net.max_prefixlen - 2 or not _usable(net.network_address):
            problems.append(f"spec.podCIDRs[{i}]: expected a network like 10.244.1.0/24, got {_show(text)}")
        elif any(c.version == net.version for c in cidrs):
            problems.append(f"spec.podCIDRs[{i}]: a second IPv{net.version} network ({net}) is ignored")
        else:
            cidrs.append(net)

    ips: list[IPAddress] = []
    for i, a in enumerate((status.addresses if status is not None else None) or []):
        if a.type != "InternalIP":
            continue
        ip = _address(a.address)
        if ip is None or not _usable(ip):
            problems.append(f"status.addresses[{i}]: expected a unicast InternalIP, got {_show(a.address)}")
        elif ip not in ips:
            ips.append(ip)

    vtep = None
    notes = meta.annotations if meta is not None and isinstance(meta.annotations, dict) else {}  # a free map
    if VTEP_MAC in notes or VTEP_ADDRESS in notes:
        mac = parse_mac(notes.get(VTEP_MAC))
        addr = _address(notes.get(VTEP_ADDRESS))
        if mac is None:
            problems.append(f"{VTEP_MAC}: expected a unicast MAC address, got {_show(notes.get(VTEP_MAC))}")
        if addr is None or not _usable(addr):
            problems.append(f"{VTEP_ADDRESS}: expected an IP address, got {_show(notes.get(VTEP_ADDRESS))}")
            addr = None
        if mac is not None and addr is not None:
            vtep = Vtep(mac, addr)
    return NodeInfo(name, tuple(cidrs), tuple(ips), vtep, tuple(problems[:MAX_PROBLEMS]))


def slim_node(obj: dict[str, Any]) -> dict[str, Any]:
    """What of a Node the cluster network reads (name, resourceVersion, nodeplug.io/ annotations, podCIDRs,
    addresses), for the list+watch to keep instead of the whole object: :func:`parse_node` gives the same for both."""
    meta, spec, status = _dict(obj.get("metadata")), _dict(obj.get("spec")), _dict(obj.get("status"))
    notes = {k: v for k, v in _dict(meta.get("annotations")).items() if isinstance(k, str) and k.startswith(
        ANNOTATION_PREFIX)}  # fmt: skip
    slim_meta = {k: meta[k] for k in ("name", "resourceVersion", "uid") if k in meta}
    if "annotations" in meta:
        slim_meta["annotations"] = notes
    slim_spec = {k: spec[k] for k in ("podCIDR", "podCIDRs") if k in spec}
    slim: dict[str, Any] = {"metadata": slim_meta, "spec": slim_spec}
    slim_status = {k: status[k] for k in ("addresses",) if k in status}
    conditions = status.get("conditions")
    if isinstance(conditions, list):
        slim_status["conditions"] = [
            c for c in conditions if isinstance(c, dict) and c.get("type") == NETWORK_UNAVAILABLE
        ]  # fmt: skip
    if slim_status:
        slim["status"] = slim_status
    return slim


def network_unavailable(node: Node) -> tuple[str, str] | None:
    """The Node's NetworkUnavailable condition as (status, reason), None when it has none."""
    for c in (node.status.conditions if node.status is not None else None) or ():
        if c.type == NETWORK_UNAVAILABLE:
            return c.status, c.reason or ""
    return None
