"""The few fields of route, neighbour and link messages the cluster network reads (dump answers, and the events
:mod:`cni.cluster.drift` listens to), straight from the bytes.

A full pass reads back every route of the agent's protocol and every FDB and neighbour entry on its VXLAN device:
thousands with thousands of Nodes. Fully decoded messages (:mod:`cni.dataplane.messages`; pyroute2's, before them,
cost kilobytes each and held reference cycles: 28 MB for 5,000 routes, seen) are more than a pass needs; these are
a few small tuples.
Malformed answers (a length past the end) end the attribute walk; nothing here raises on the kernel's bytes.
"""

from __future__ import annotations

import ipaddress
import struct
from typing import NamedTuple

from cni.cluster.model import IPAddress
from cni.dataplane import nlwire
from cni.dataplane.nlwire import IFINFOMSG, NDMSG, NLMSGHDR, RTMSG

_U32 = struct.Struct("=I")

RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_TABLE = 1, 4, 5, 15
NDA_DST, NDA_LLADDR = 1, 2
IFLA_IFNAME, IFLA_IFALIAS = 3, 20


def _attrs(data: bytes, offset: int) -> dict[int, bytes]:
    return {kind: data[start:end] for kind, start, end in nlwire.attrs(data, offset)}


def _address(raw: bytes | None) -> IPAddress | None:
    if raw is None or len(raw) not in (4, 16):
        return None
    return ipaddress.ip_address(raw)


class Route(NamedTuple):
    family: int
    dst_len: int
    table: int
    protocol: int
    type: int
    dst: IPAddress | None
    gateway: IPAddress | None
    oif: int | None


def route(data: bytes) -> Route | None:
    """A route dump answer (netlink header included); None when too short to be one."""
    if len(data) < NLMSGHDR.size + RTMSG.size:
        return None
    family, dst_len, _, _, table, protocol, _, rtype, _ = RTMSG.unpack_from(data, NLMSGHDR.size)
    a = _attrs(data, NLMSGHDR.size + RTMSG.size)
    if RTA_TABLE in a and len(a[RTA_TABLE]) == 4:
        table = _U32.unpack(a[RTA_TABLE])[0]
    oif = _U32.unpack(a[RTA_OIF])[0] if len(a.get(RTA_OIF, b"")) == 4 else None
    return Route(family, dst_len, table, protocol, rtype, _address(a.get(RTA_DST)), _address(a.get(RTA_GATEWAY)), oif)


class Neighbour(NamedTuple):
    family: int
    ifindex: int
    state: int
    dst: IPAddress | None
    lladdr: str | None  # colon-separated, lower case


def neighbour(data: bytes) -> Neighbour | None:
    """A neighbour (or FDB) dump answer (netlink header included); None when too short to be one."""
    if len(data) < NLMSGHDR.size + NDMSG.size:
        return None
    family, ifindex, state, _, _ = NDMSG.unpack_from(data, NLMSGHDR.size)
    a = _attrs(data, NLMSGHDR.size + NDMSG.size)
    mac = a.get(NDA_LLADDR)
    lladdr = ":".join(f"{b:02x}" for b in mac) if mac is not None and len(mac) == 6 else None
    return Neighbour(family, ifindex, state, _address(a.get(NDA_DST)), lladdr)


class Link(NamedTuple):
    ifindex: int
    name: str
    alias: str


def _text(raw: bytes | None) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace") if raw else ""


def link(data: bytes) -> Link | None:
    """A link message (netlink header included): its index, name and alias; None when too short to be one."""
    if len(data) < NLMSGHDR.size + IFINFOMSG.size:
        return None
    _, _, index, _, _ = IFINFOMSG.unpack_from(data, NLMSGHDR.size)
    a = _attrs(data, NLMSGHDR.size + IFINFOMSG.size)
    return Link(index, _text(a.get(IFLA_IFNAME)), _text(a.get(IFLA_IFALIAS)))
