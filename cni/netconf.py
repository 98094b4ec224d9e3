"""Network configuration: the JSON a runtime writes on stdin, parsed into frozen values.

Two shapes reach the entry point:

- :class:`BridgeConf` — nodeplug as the main plugin (``"type": "nodeplug"``), with the reference ``bridge`` plugin's
  key names (bridge, mtu, isGateway, isDefaultGateway, forceAddress, ipMasq, hairpinMode, promiscMode, vlan, ipam, dns)
  plus ``datapath`` (``bridge``, the default, or ``routed``: see :mod:`cni.dataplane.routed`), ``socket`` (where the
  agent serves thick mode) and ``agentTimeout`` (how long the entry point waits for the
  agent to take a request before doing the work itself, in all: the bundle's launcher, which cannot read it, waits
  its own 0.5 s and hands over the rest, so a stuck agent costs the longer of the two, once);
- :class:`IpamPluginConf` — nodeplug as *another* plugin's IPAM (the top-level ``type`` is someone else's, e.g. the
  reference ``bridge``, and ``ipam.type`` is ``"nodeplug"``). Only the keys IPAM needs are read, so the calling
  plugin's own fields (which may clash with ours in type) are never judged.

:func:`parse` tells them apart (see :func:`is_ipam_invocation`). Unknown keys are ignored, as the spec allows; the
keys we read are type-checked and a bad one is a code 7 error naming it: ``mtu: expected an integer from 68 to 65535,
got "abc"``. Standard library only, and cheap: it runs on every standalone call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from cni import strictjson
from cni.errors import DECODE_FAILURE, INVALID_NETWORK_CONFIG, CniError
from cni.thick import DEFAULT_AGENT_TIMEOUT, DEFAULT_SOCKET, agent_timeout_ok
from cni.types import (
    DNS,
    EMPTY,
    IPAddress,
    IPNetwork,
    Result,
    Route,
    _bad,
    get_int,
    parse_address,
    parse_network,
    repr_without,
)

PLUGIN_TYPE = "nodeplug"
DEFAULT_BRIDGE = "nodeplug0"
# How a pod is attached: to the bridge, or by a routed veth of its own. A config that names none is a bridge config
# (every config written before the routed datapath existed); ``nodeplug install-cni`` writes the key.
DATAPATHS = ("bridge", "routed")
DEFAULT_DATAPATH = "bridge"
DEFAULT_DATA_DIR = "/var/lib/nodeplug/ipam"
VALID_ATTACHMENTS_KEY = "cni.dev/valid-attachments"
ATTACHMENTS_KEY = "cni.dev/attachments"  # the spec's earlier spelling; libcni sends both

_NETWORK_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$")
_IFNAME_BAD = re.compile(r"[/:\s]")
IFNAME_RULE = "an interface name of 1-15 characters without '/', ':' or spaces"


def ifname_ok(name: str) -> bool:
    """Linux interface name rules (the bridge in a config, ``CNI_IFNAME``): 1-15 bytes, no '/', ':' or whitespace,
    not '.' or '..'."""
    return bool(name) and len(name.encode()) <= 15 and not _IFNAME_BAD.search(name) and name not in (".", "..")


def check_ifname(name: str, where: str) -> str:
    """``name`` when it follows :func:`ifname_ok`, else code 7 naming ``where``."""
    if not ifname_ok(name):
        raise _bad(where, IFNAME_RULE, name)
    return name


class RangeConf(NamedTuple):
    """One range of a range set: addresses ``range_start``..``range_end`` of ``subnet``; ``gateway`` is never leased."""

    subnet: IPNetwork
    range_start: IPAddress
    range_end: IPAddress
    gateway: IPAddress | None

    def contains(self, ip: IPAddress) -> bool:
        return ip.version == self.subnet.version and int(self.range_start) <= int(ip) <= int(self.range_end)


class IpamConf(NamedTuple):
    """The built-in IPAM's section (``"ipam": {"type": "nodeplug", ...}``); one address is leased per range set.

    With ``nodeSubnets`` (a file the agent writes, :mod:`cni.nodesubnets`) the ranges are this node's podCIDRs;
    ``no_ranges`` then says why there are none (ADD and STATUS fail with it), and ``mtu`` is the pod MTU the agent
    chose for the cluster network."""

    ranges: tuple[tuple[RangeConf, ...], ...]
    routes: tuple[Route, ...] = ()
    data_dir: str = DEFAULT_DATA_DIR
    dns: DNS = DNS()
    no_ranges: str = ""
    mtu: int | None = None


class BridgeConf(NamedTuple):
    name: str
    cni_version: str
    type: str = PLUGIN_TYPE
    bridge: str = DEFAULT_BRIDGE
    datapath: str = DEFAULT_DATAPATH
    mtu: int | None = None
    is_gateway: bool = False
    is_default_gateway: bool = False
    force_address: bool = False
    ip_masq: bool = False
    hairpin_mode: bool = False
    promisc_mode: bool = False
    vlan: int | None = None
    ipam: Mapping[str, Any] = EMPTY
    ipam_conf: IpamConf | None = None  # parsed when ipam.type is "nodeplug"
    dns: DNS = DNS()
    socket: str = DEFAULT_SOCKET
    agent_timeout: float = DEFAULT_AGENT_TIMEOUT  # seconds the entry point waits for the agent to take a request
    prev_result: Result | None = None
    runtime_config: Mapping[str, Any] = EMPTY
    args: Mapping[str, Any] = EMPTY
    valid_attachments: tuple[tuple[str, str], ...] | None = None  # GC only: (container_id, ifname) to keep
    raw: Mapping[str, Any] = EMPTY

    def __repr__(self) -> str:
        return repr_without(self, ("raw",))

    @property
    def ipam_type(self) -> str:
        return str(self.ipam.get("type", ""))

    @property
    def routed(self) -> bool:
        return self.datapath == "routed"


class IpamPluginConf(NamedTuple):
    """nodeplug called as another plugin's IPAM: only the keys IPAM needs."""

    name: str
    cni_version: str
    type: str
    ipam_conf: IpamConf
    prev_result: Result | None = None
    runtime_config: Mapping[str, Any] = EMPTY
    args: Mapping[str, Any] = EMPTY
    valid_attachments: tuple[tuple[str, str], ...] | None = None
    raw: Mapping[str, Any] = EMPTY

    def __repr__(self) -> str:
        return repr_without(self, ("raw",))


NetConf = BridgeConf | IpamPluginConf


# ---------------------------------------------------------------- field readers


def _get_str(d: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = d.get(key)
    if v is None:
        if default is None:
            raise CniError(INVALID_NETWORK_CONFIG, details=f"{where}{key}: required field is missing")
        return default
    if not isinstance(v, str):
        raise _bad(f"{where}{key}", "a string", v)
    return v


def _get_bool(d: Mapping[str, Any], key: str, where: str = "") -> bool:
    v = d.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{where}{key}", "true or false", v)
    return v


def _get_obj(d: Mapping[str, Any], key: str, where: str = "") -> dict[str, Any]:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad(f"{where}{key}", "an object", v)
    return v


# ---------------------------------------------------------------- IPAM section


def _parse_range(d: Any, where: str) -> RangeConf:
    if not isinstance(d, dict):
        raise _bad(where, "an object with subnet (and optional rangeStart, rangeEnd, gateway)", d)
    if "subnet" not in d:
        raise CniError(INVALID_NETWORK_CONFIG, details=f"{where}.subnet: required field is missing")
    subnet = parse_network(d["subnet"], f"{where}.subnet")
    if subnet.prefixlen > subnet.max_prefixlen - 2:
        raise _bad(f"{where}.subnet", "a network of at least 4 addresses (/30 or /126 at most)", d["subnet"])
    first = subnet.network_address + 1
    last = subnet.broadcast_address - 1 if subnet.version == 4 else subnet.broadcast_address

    def addr(key: str, default: IPAddress | None) -> IPAddress | None:
        v = d.get(key)
        if v in (None, ""):
            return default
        ip = parse_address(v, f"{where}.{key}")
        if ip not in subnet:
            raise _bad(f"{where}.{key}", f"an address inside {subnet}", v)
        return ip

    start = addr("rangeStart", first)
    end = addr("rangeEnd", last)
    gateway = addr("gateway", first)
    assert start is not None and end is not None
    if int(start) < int(first) or int(start) > int(last):
        raise _bad(f"{where}.rangeStart", f"an assignable address of {subnet} ({first}-{last})", str(start))
    if int(end) < int(start) or int(end) > int(last):
        raise _bad(
            f"{where}.rangeEnd", f"an assignable address of {subnet} from rangeStart {start} to {last}", str(end)
        )
    return RangeConf(subnet, start, end, gateway)


def _overlap(a: RangeConf, b: RangeConf) -> bool:
    return a.subnet.version == b.subnet.version and not (
        int(a.range_end) < int(b.range_start) or int(b.range_end) < int(a.range_start)
    )


def _node_subnets(path: Any, where: str) -> tuple[list[list[dict[str, str]]], str, int | None]:
    """Range sets from the agent's subnets file (one per podCIDR), or why there are none, and the pod MTU."""
    from cni import nodesubnets as subnets

    if not isinstance(path, str) or not path.startswith("/"):
        raise _bad(f"{where}.nodeSubnets", "an absolute path to the file the agent writes", path)
    try:
        got = subnets.read(path)
    except subnets.SubnetsError as e:
        return [], f"this node's pod subnets are unreadable: {e}", None
    if got is None:
        return (
            [],
            (
                f"no pod subnet for this node yet: {path} is missing. The nodeplug agent writes it from the Node's "
                "spec.podCIDRs once it has reached the API server: check that the agent runs and can reach it"
            ),
            None,
        )
    if not got.pod_cidrs and got.refused:
        return (
            [],
            f"node {got.node} has no usable pod subnet: the nodeplug agent refused "
            + "; ".join(f"{cidr} ({why})" for cidr, why in got.refused)
            + ". Correct the Node's spec.podCIDRs (or the cluster_network.cluster_cidrs of the agent config)",
            got.mtu,
        )
    if not got.pod_cidrs:
        return (
            [],
            (
                f"node {got.node} has no pod subnet: its spec.podCIDRs is empty. Run kube-controller-manager with "
                f"--allocate-node-cidrs --cluster-cidr=..., or set it: kubectl patch node {got.node} -p "
                '\'{"spec":{"podCIDR":"10.244.1.0/24","podCIDRs":["10.244.1.0/24"]}}\''
            ),
            got.mtu,
        )
    return [[{"subnet": c}] for c in got.pod_cidrs], "", got.mtu


def parse_ipam(d: Mapping[str, Any], where: str = "ipam") -> IpamConf:
    """The ``ipam`` section when its type is ``nodeplug``; host-local's single-range shorthand is accepted, and
    ``nodeSubnets`` (this node's podCIDRs, from the agent) in place of ``ranges``."""
    raw_sets = d.get("ranges")
    if raw_sets is None and "subnet" in d:
        raw_sets = [[{k: d[k] for k in ("subnet", "rangeStart", "rangeEnd", "gateway") if k in d}]]
    no_ranges, mtu = "", None
    if raw_sets is None and "nodeSubnets" in d:
        raw_sets, no_ranges, mtu = _node_subnets(d["nodeSubnets"], where)
        if not raw_sets:
            return IpamConf((), (), _data_dir(d, where), DNS.from_dict(d.get("dns"), f"{where}.dns"), no_ranges, mtu)
    if not isinstance(raw_sets, list) or not raw_sets:
        raise _bad(f"{where}.ranges", 'a non-empty list of range sets like [[{"subnet": "10.22.0.0/16"}]]', raw_sets)
    sets: list[tuple[RangeConf, ...]] = []
    for i, rs in enumerate(raw_sets):
        if not isinstance(rs, list) or not rs:
            raise _bad(f"{where}.ranges[{i}]", "a non-empty list of ranges", rs)
        ranges = tuple(_parse_range(r, f"{where}.ranges[{i}][{j}]") for j, r in enumerate(rs))
        for j, r in enumerate(ranges):
            if r.subnet.version != ranges[0].subnet.version:
                raise _bad(
                    f"{where}.ranges[{i}][{j}].subnet", f"an IPv{ranges[0].subnet.version} network", str(r.subnet)
                )
        sets.append(ranges)
    flat = [(i, j, r) for i, rs in enumerate(sets) for j, r in enumerate(rs)]
    for n, (i, j, r) in enumerate(flat):
        for i2, j2, r2 in flat[n + 1 :]:
            if _overlap(r, r2):
                raise CniError(
                    INVALID_NETWORK_CONFIG,
                    details=f"{where}.ranges[{i2}][{j2}]: overlaps {where}.ranges[{i}][{j}] ({r.subnet})",
                )
    raw_routes = d.get("routes") or []
    if not isinstance(raw_routes, list):
        raise _bad(f"{where}.routes", "a list of routes", raw_routes)
    routes = tuple(Route.from_dict(r, f"{where}.routes[{k}]") for k, r in enumerate(raw_routes))
    dns = DNS.from_dict(d.get("dns"), f"{where}.dns")
    return IpamConf(tuple(sets), routes, _data_dir(d, where), dns, no_ranges, mtu)


def _data_dir(d: Mapping[str, Any], where: str) -> str:
    data_dir = _get_str(d, "dataDir", f"{where}.", DEFAULT_DATA_DIR)
    if not data_dir.startswith("/"):
        raise _bad(f"{where}.dataDir", "an absolute path", data_dir)
    return data_dir


# ---------------------------------------------------------------- top level


def _common(d: Mapping[str, Any]) -> tuple[str, str, Result | None, dict[str, Any], dict[str, Any], Any]:
    version = _get_str(d, "cniVersion", "")
    name = _get_str(d, "name", "")
    if not _NETWORK_NAME.match(name):
        raise _bad("name", "a network name of letters, digits, '_', '.' and '-' starting with a letter or digit", name)
    prev = d.get("prevResult")
    prev_result = Result.from_dict(prev, "prevResult") if prev is not None else None
    return (
        version,
        name,
        prev_result,
        _get_obj(d, "runtimeConfig"),
        _get_obj(d, "args"),
        _valid_attachments(d[VALID_ATTACHMENTS_KEY] if VALID_ATTACHMENTS_KEY in d else d.get(ATTACHMENTS_KEY)),
    )


def _valid_attachments(v: Any) -> tuple[tuple[str, str], ...] | None:
    if v is None:
        return None
    where = VALID_ATTACHMENTS_KEY
    if not isinstance(v, list):
        raise _bad(where, 'a list of {"containerID", "ifname"} objects', v)
    out = []
    for i, a in enumerate(v):
        if not isinstance(a, dict):
            raise _bad(f"{where}[{i}]", 'an object {"containerID", "ifname"}', a)
        out.append((_get_str(a, "containerID", f"{where}[{i}]."), _get_str(a, "ifname", f"{where}[{i}].")))
    return tuple(out)


def is_ipam_invocation(d: Mapping[str, Any]) -> bool:
    """Called as another plugin's IPAM: the top-level type is not ours while ``ipam.type`` is."""
    ipam = d.get("ipam")
    return d.get("type") != PLUGIN_TYPE and isinstance(ipam, dict) and ipam.get("type") == PLUGIN_TYPE


def decode(data: bytes | str) -> dict[str, Any]:
    """Bytes from stdin -> a JSON object (code 6 when it is not one: not UTF-8, not strict JSON (``NaN`` and
    ``Infinity`` are not), nested too deeply, or not an object)."""
    try:
        d = strictjson.loads(data)
    except ValueError as e:  # UnicodeDecodeError is one too
        raise CniError(DECODE_FAILURE, details=f"network config on stdin is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CniError(DECODE_FAILURE, details=f"network config on stdin must be a JSON object, got {type(d).__name__}")
    return d


def parse(d: Mapping[str, Any]) -> NetConf:
    """A decoded config -> :class:`BridgeConf` or, for an IPAM invocation, :class:`IpamPluginConf`."""
    if is_ipam_invocation(d):
        return parse_ipam_plugin(d)
    return parse_bridge(d)


def parse_ipam_plugin(d: Mapping[str, Any]) -> IpamPluginConf:
    version, name, prev, rc, args, valid = _common(d)
    ipam = _get_obj(d, "ipam")
    return IpamPluginConf(
        name=name,
        cni_version=version,
        type=_get_str(d, "type", "", ""),
        ipam_conf=parse_ipam(ipam),
        prev_result=prev,
        runtime_config=rc,
        args=args,
        valid_attachments=valid,
        raw=d,
    )


def parse_bridge(d: Mapping[str, Any]) -> BridgeConf:
    version, name, prev, rc, args, valid = _common(d)
    ipam = _get_obj(d, "ipam")
    ipam_type = ipam.get("type")
    if ipam and not isinstance(ipam_type, str):
        raise _bad("ipam.type", 'a plugin name like "nodeplug" or "host-local"', ipam_type)
    if ipam_type is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", ipam_type):
        raise _bad("ipam.type", "a plugin file name (no '/')", ipam_type)
    bridge = check_ifname(_get_str(d, "bridge", "", DEFAULT_BRIDGE), "bridge")
    datapath = _get_str(d, "datapath", "", DEFAULT_DATAPATH)
    if datapath not in DATAPATHS:
        raise _bad("datapath", " or ".join(f'"{p}"' for p in DATAPATHS), datapath)
    vlan = get_int(d, "vlan", 0, 4094)
    if vlan and datapath == "routed":
        raise _bad("vlan", 'nothing with "datapath": "routed" (a VLAN is a bridge setting)', vlan)
    socket = _get_str(d, "socket", "", DEFAULT_SOCKET)
    if not socket.startswith("/"):
        raise _bad("socket", "an absolute path to the agent's CNI socket", socket)
    is_default_gateway = _get_bool(d, "isDefaultGateway")
    agent_timeout = d.get("agentTimeout", DEFAULT_AGENT_TIMEOUT)
    if not agent_timeout_ok(agent_timeout):
        raise _bad("agentTimeout", "a number of seconds above 0 and at most 60", agent_timeout)
    ipam_conf = parse_ipam(ipam) if ipam_type == PLUGIN_TYPE else None
    mtu = get_int(d, "mtu", 68, 65535)
    if mtu is None and ipam_conf is not None:
        mtu = ipam_conf.mtu  # the cluster network's pod MTU (overlay overhead accounted for), unless set here
    return BridgeConf(
        name=name,
        cni_version=version,
        type=_get_str(d, "type", "", PLUGIN_TYPE),
        bridge=bridge,
        datapath=datapath,
        mtu=mtu,
        is_gateway=_get_bool(d, "isGateway") or is_default_gateway,
        is_default_gateway=is_default_gateway,
        force_address=_get_bool(d, "forceAddress"),
        ip_masq=_get_bool(d, "ipMasq"),
        hairpin_mode=_get_bool(d, "hairpinMode"),
        promisc_mode=_get_bool(d, "promiscMode"),
        vlan=vlan,
        ipam=ipam,
        ipam_conf=ipam_conf,
        dns=DNS.from_dict(d.get("dns")),
        socket=socket,
        agent_timeout=float(agent_timeout),
        prev_result=prev,
        runtime_config=rc,
        args=args,
        valid_attachments=valid,
        raw=d,
    )
