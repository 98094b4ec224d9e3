"""CNI result values (spec 1.1.0 "Success" shape) as immutable named tuples.

``Result.to_dict`` / ``Result.from_dict`` speak the 1.x wire shape (1.1.0 fields included); conversion to and from
the older result versions (0.3.0, 0.3.1, 0.4.0) lives in :mod:`cni.versions` only. ``from_dict`` validates types and
raises :class:`cni.errors.CniError` (code 7, naming the field) so a malformed ``prevResult`` is reported precisely.

This module is on the entry point's start-up path: standard library only. The CNI value types (here, in
:mod:`cni.netconf`, :mod:`cni.skel` and :mod:`cni.ipam.store`) are ``typing.NamedTuple`` rather than frozen
dataclasses because every standalone CNI exec imports them: a frozen dataclass costs about 1 ms to create (its methods
are generated and compiled) and ``dataclasses`` brings ``inspect`` along (about 8 ms); a named tuple costs 0.1 ms.
Copies with changes are ``value._replace(field=...)``.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

from cni.errors import INVALID_NETWORK_CONFIG, CniError

IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
T = TypeVar("T")
EMPTY: Mapping[str, Any] = MappingProxyType({})  # the default of mapping fields: shared, so read-only


def repr_without(value: Any, hidden: Sequence[str]) -> str:
    """``repr`` of a named tuple without the ``hidden`` fields (the raw config, a request's environment and stdin:
    nothing a log line or a traceback should carry)."""
    shown = ", ".join(f"{name}={v!r}" for name, v in zip(value._fields, value, strict=True) if name not in hidden)
    return f"{type(value).__name__}({shown})"


def _bad(where: str, expected: str, got: Any) -> CniError:
    return CniError(INVALID_NETWORK_CONFIG, details=f"{where}: expected {expected}, got {_show(got)}")


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _str(d: Mapping[str, Any], key: str, where: str, required: bool = False) -> str:
    v = d.get(key)
    if v is None:
        if required:
            raise CniError(INVALID_NETWORK_CONFIG, details=f"{where}.{key}: required field is missing")
        return ""
    if not isinstance(v, str):
        raise _bad(f"{where}.{key}", "a string", v)
    return v


def get_int(d: Mapping[str, Any], key: str, lo: int, hi: int, where: str = "") -> int | None:
    """``d[key]``: absent is None, else an integer from ``lo`` to ``hi`` (a bool is not one); the error names the
    field as ``where`` + ``key`` (``where`` ends with its own dot)."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{where}{key}", f"an integer from {lo} to {hi}", v)
    return v


def _parsed(v: Any, where: str, expected: str, parse: Callable[[str], T], cidr: bool = False) -> T:
    """``parse(v)`` for a string ``v`` (with a ``/`` when ``cidr``); anything else is code 7 naming ``where``."""
    if not isinstance(v, str) or (cidr and "/" not in v):
        raise _bad(where, expected, v)
    try:
        return parse(v)
    except ValueError:
        raise _bad(where, expected, v) from None


def parse_interface_address(v: Any, where: str) -> IPInterface:
    """``"10.1.0.5/24"`` (an address with its prefix length) -> IPv4Interface / IPv6Interface."""
    return _parsed(v, where, "an address in CIDR notation like 10.22.0.5/24", ipaddress.ip_interface, cidr=True)


def parse_address(v: Any, where: str) -> IPAddress:
    return _parsed(v, where, "an IP address", ipaddress.ip_address)


def parse_network(v: Any, where: str) -> IPNetwork:
    """A destination like ``"0.0.0.0/0"``; host bits are allowed and masked off (as the Go reference does)."""
    return _parsed(
        v, where, "a network in CIDR notation like 10.22.0.0/16", lambda s: ipaddress.ip_network(s, strict=False), True
    )


class Interface(NamedTuple):
    name: str
    mac: str = ""
    sandbox: str = ""
    mtu: int | None = None
    socket_path: str = ""
    pci_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.mac:
            out["mac"] = self.mac
        if self.mtu is not None:
            out["mtu"] = self.mtu
        if self.sandbox:
            out["sandbox"] = self.sandbox
        if self.socket_path:
            out["socketPath"] = self.socket_path
        if self.pci_id:
            out["pciID"] = self.pci_id
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "interfaces[0]") -> Interface:
        if not isinstance(d, dict):
            raise _bad(where, "an object", d)
        return cls(
            name=_str(d, "name", where, required=True),
            mac=_str(d, "mac", where),
            sandbox=_str(d, "sandbox", where),
            mtu=get_int(d, "mtu", 0, 65535, f"{where}."),
            socket_path=_str(d, "socketPath", where),
            pci_id=_str(d, "pciID", where),
        )


def _object_with(d: Any, key: str, where: str) -> dict[str, Any]:
    """``d`` when it is an object holding ``key``."""
    if not isinstance(d, dict):
        raise _bad(where, "an object", d)
    if key not in d:
        raise CniError(INVALID_NETWORK_CONFIG, details=f"{where}.{key}: required field is missing")
    return d


def _gateway(d: Mapping[str, Any], key: str, where: str, version: int, like: str) -> IPAddress | None:
    """The optional gateway ``d[key]`` ("" is absent too), an address of IP ``version`` like ``like``'s."""
    raw = d.get(key)
    if raw in (None, ""):
        return None
    gateway = parse_address(raw, f"{where}.{key}")
    if gateway.version != version:
        raise _bad(f"{where}.{key}", f"an IPv{version} address like {like}", raw)
    return gateway


class IPConfig(NamedTuple):
    address: IPInterface
    gateway: IPAddress | None = None
    interface: int | None = None

    @property
    def version(self) -> int:
        return self.address.version

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"address": str(self.address)}
        if self.gateway is not None:
            out["gateway"] = str(self.gateway)
        if self.interface is not None:
            out["interface"] = self.interface
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "ips[0]") -> IPConfig:
        d = _object_with(d, "address", where)
        address = parse_interface_address(d["address"], f"{where}.address")
        gateway = _gateway(d, "gateway", where, address.version, "the address")
        return cls(address, gateway, get_int(d, "interface", 0, 1 << 31, f"{where}."))


class Route(NamedTuple):
    dst: IPNetwork
    gw: IPAddress | None = None
    mtu: int | None = None
    advmss: int | None = None
    priority: int | None = None
    table: int | None = None
    scope: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dst": str(self.dst)}
        if self.gw is not None:
            out["gw"] = str(self.gw)
        for key in ("mtu", "advmss", "priority", "table", "scope"):
            v = getattr(self, key)
            if v is not None:
                out[key] = v
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "routes[0]") -> Route:
        d = _object_with(d, "dst", where)
        dst = parse_network(d["dst"], f"{where}.dst")
        return cls(
            dst,
            _gateway(d, "gw", where, dst.version, "dst"),
            mtu=get_int(d, "mtu", 0, 65535, f"{where}."),
            advmss=get_int(d, "advmss", 0, 65535, f"{where}."),
            priority=get_int(d, "priority", 0, (1 << 32) - 1, f"{where}."),
            table=get_int(d, "table", 0, (1 << 32) - 1, f"{where}."),
            scope=get_int(d, "scope", 0, 255, f"{where}."),
        )


class DNS(NamedTuple):
    nameservers: tuple[str, ...] = ()
    domain: str = ""
    search: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.nameservers or self.domain or self.search or self.options)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.nameservers:
            out["nameservers"] = list(self.nameservers)
        if self.domain:
            out["domain"] = self.domain
        if self.search:
            out["search"] = list(self.search)
        if self.options:
            out["options"] = list(self.options)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "dns") -> DNS:
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise _bad(where, "an object", d)

        def strings(key: str) -> tuple[str, ...]:
            v = d.get(key)
            if v is None:
                return ()
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise _bad(f"{where}.{key}", "a list of strings", v)
            return tuple(v)

        return cls(strings("nameservers"), _str(d, "domain", where), strings("search"), strings("options"))


class Result(NamedTuple):
    """A CNI success result, held in the 1.x shape whatever version it was read from or will be written as."""

    cni_version: str = "1.1.0"
    interfaces: tuple[Interface, ...] = ()
    ips: tuple[IPConfig, ...] = ()
    routes: tuple[Route, ...] = ()
    dns: DNS = DNS()

    def to_dict(self) -> dict[str, Any]:
        """The 1.x wire shape (what 1.0.0 and 1.1.0 print); see :func:`cni.versions.result_to_version`."""
        out: dict[str, Any] = {"cniVersion": self.cni_version}
        if self.interfaces:
            out["interfaces"] = [i.to_dict() for i in self.interfaces]
        if self.ips:
            out["ips"] = [ip.to_dict() for ip in self.ips]
        if self.routes:
            out["routes"] = [r.to_dict() for r in self.routes]
        out["dns"] = self.dns.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "prevResult") -> Result:
        """Read a 1.x-shaped result (older shapes differ only in fields this ignores: ``ips[].version``)."""
        if not isinstance(d, dict):
            raise _bad(where, "an object", d)

        def items(key: str) -> Sequence[Any]:
            v = d.get(key)
            if v is None:
                return []
            if not isinstance(v, list):
                raise _bad(f"{where}.{key}", "a list", v)
            return v

        version = d.get("cniVersion", "1.1.0")
        if not isinstance(version, str):
            raise _bad(f"{where}.cniVersion", "a version string", version)
        interfaces = tuple(
            Interface.from_dict(x, f"{where}.interfaces[{i}]") for i, x in enumerate(items("interfaces"))
        )
        ips = tuple(IPConfig.from_dict(x, f"{where}.ips[{i}]") for i, x in enumerate(items("ips")))
        for i, ip in enumerate(ips):
            if ip.interface is not None and ip.interface >= len(interfaces):
                raise _bad(f"{where}.ips[{i}].interface", f"an index below {len(interfaces)}", ip.interface)
        routes = tuple(Route.from_dict(x, f"{where}.routes[{i}]") for i, x in enumerate(items("routes")))
        return cls(version, interfaces, ips, routes, DNS.from_dict(d.get("dns"), f"{where}.dns"))
