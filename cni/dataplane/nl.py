"""Netlink helpers: sockets on each side, the few requests the dataplane makes, and kernel errors as CNI errors.

One :class:`~cni.dataplane.rtnl.Rtnl` socket per side per call: the host side is the calling thread's netns; the pod
side is opened from inside the pod's netns (see :mod:`cni.dataplane.netns`) and keeps talking to it from anywhere.
Requests are the messages of :mod:`cni.dataplane.messages` (``LinkMsg``, ``AddrMsg``, ``RouteMsg``, ``NeighMsg``)
built here with the attributes the dataplane sets, so the rest of the dataplane reads as what it does ("add this
address", "get that link").
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cni.dataplane.messages import AddrMsg, LinkMsg, NeighMsg, RouteMsg
from cni.dataplane.netns import entered
from cni.dataplane.nlwire import NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE
from cni.dataplane.rtnl import (
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_DELNEIGH,
    RTM_GETADDR,
    RTM_GETLINK,
    RTM_GETNEIGH,
    RTM_GETROUTE,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWNEIGH,
    RTM_NEWROUTE,
    NetlinkError,
    Rtnl,
)
from cni.errors import DATAPLANE, TRY_AGAIN_LATER, CniError
from cni.types import Route

IFF_UP = 0x1
IFF_PROMISC = 0x100
BRIDGE_VLAN_INFO_PVID = 0x2
BRIDGE_VLAN_INFO_UNTAGGED = 0x4
IFA_F_NODAD = 0x02
IN6_ADDR_GEN_MODE_NONE = 1  # IFLA_INET6_ADDR_GEN_MODE: no link-local address made when the link comes up
RTEXT_FILTER_SKIP_STATS = 1 << 3  # link replies without the counters (smaller, faster to decode)
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
RTPROT_STATIC = 4  # as `ip route add` and pyroute2 mark routes added by an administrator
RTN_UNICAST = 1
RT_TABLE_MAIN = 254
RTNH_F_ONLINK = 4  # the gateway is on the link, whatever the link's addresses say
NUD_PERMANENT = 0x80
NTF_PROXY = 0x08  # a proxy neighbour entry: the kernel answers neighbour solicitations for the address
CREATE = NLM_F_CREATE | NLM_F_EXCL  # an add: refused (EEXIST) when the object is already there
AF_INET = socket.AF_INET
AF_INET6 = socket.AF_INET6

IPIface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
Attr = tuple[str, Any]

__all__ = ["NetlinkError", "Rtnl"]


_TRANSIENT = frozenset({errno.ETIMEDOUT, errno.EAGAIN, errno.ENOBUFS})  # load, not a fault: try again later


def nl_error(what: str, e: BaseException) -> CniError:
    """``what`` failed: a CniError carrying the kernel's reason (and its extended message, if any); code 11 (try
    again later) for a transient condition (no answer in time, no buffer space), else 101."""
    code = 0
    if isinstance(e, NetlinkError):
        code = e.code
        reason = str(e.args[1]) if len(e.args) > 1 and e.args[1] else os.strerror(e.code)
    elif isinstance(e, OSError) and e.errno:
        code = e.errno
        reason = e.strerror or os.strerror(e.errno)
    else:
        reason = str(e)
    return CniError(TRY_AGAIN_LATER if code in _TRANSIENT else DATAPLANE, details=f"{what}: {reason}")


@contextmanager
def host_socket() -> Iterator[Rtnl]:
    """A netlink socket in the calling thread's netns."""
    try:
        nl = Rtnl()
    except OSError as e:
        raise nl_error("open a netlink socket", e) from None
    try:
        yield nl
    finally:
        nl.close()


@contextmanager
def socket_in(nsfd: int, netns: str, inside: Callable[[], None] | None = None) -> Iterator[Rtnl]:
    """A netlink socket bound to the netns ``nsfd``, opened by this thread from inside it. ``inside`` runs there too
    (for sysctls of the pod), so one trip into the netns serves both."""
    try:
        with entered(nsfd):
            nl = Rtnl()
            try:
                if inside is not None:
                    inside()
            except BaseException:
                nl.close()
                raise
    except OSError as e:
        raise nl_error(f"enter the network namespace {netns}", e) from None
    try:
        yield nl
    finally:
        nl.close()


# ---------------------------------------------------------------- links


def link_msg(index: int = 0, attrs: Sequence[Attr] = (), flags: int = 0, change: int = 0, family: int = 0) -> LinkMsg:
    """A link message for link ``index`` (0: named by IFLA_IFNAME in ``attrs``); ``flags`` under the mask
    ``change``."""
    msg = LinkMsg(family=family, index=index, flags=flags, change=change)
    msg["attrs"] = attrs
    return msg


def create_link(nl: Rtnl, attrs: Sequence[Attr]) -> None:
    """RTM_NEWLINK with CREATE|EXCL: NetlinkError EEXIST when the name is taken."""
    nl.ack(link_msg(attrs=attrs), RTM_NEWLINK, CREATE)


def set_link(nl: Rtnl, index: int, attrs: Sequence[Attr] = (), flags: int = 0, change: int = 0) -> None:
    """Change link ``index``: ``flags`` under the mask ``change``, and ``attrs``."""
    nl.ack(link_msg(index, attrs, flags, change), RTM_NEWLINK)


def linkinfo(kind: str = "", data: Sequence[Attr] = (), slave_kind: str = "", slave_data: Sequence[Attr] = ()) -> Attr:
    """IFLA_LINKINFO: the link's kind and its kind-specific data, and/or its port data under a master of
    ``slave_kind`` (e.g. a bridge port's hairpin mode)."""
    info: list[Attr] = []
    if kind:
        info.append(("IFLA_INFO_KIND", kind))
        if data:
            info.append(("IFLA_INFO_DATA", list(data)))
    if slave_kind:
        info.append(("IFLA_INFO_SLAVE_KIND", slave_kind))
        if slave_data:
            info.append(("IFLA_INFO_SLAVE_DATA", list(slave_data)))
    return ("IFLA_LINKINFO", info)


def get_link(nl: Rtnl, name: str) -> LinkMsg | None:
    """The RTM_NEWLINK message of ``name`` (without counters), or None when there is no such link."""
    msg = link_msg(attrs=[("IFLA_IFNAME", name), ("IFLA_EXT_MASK", RTEXT_FILTER_SKIP_STATS)])
    try:
        return nl.get(msg, RTM_GETLINK, LinkMsg)
    except NetlinkError as e:
        if e.code == errno.ENODEV:
            return None
        raise


def delete_link(nl: Rtnl, name: str) -> None:
    """Delete link ``name``: NetlinkError ENODEV when there is none."""
    nl.ack(link_msg(attrs=[("IFLA_IFNAME", name)]), RTM_DELLINK)


def links(nl: Rtnl) -> list[LinkMsg]:
    """Every link of the socket's netns (without counters)."""
    return nl.dump(link_msg(attrs=[("IFLA_EXT_MASK", RTEXT_FILTER_SKIP_STATS)]), RTM_GETLINK, LinkMsg)


def port_vlan_msg(index: int, vid: int, flags: int) -> LinkMsg:
    """Bridge port ``index``'s VLAN ``vid`` (AF_BRIDGE, IFLA_AF_SPEC): sent as RTM_SETLINK it adds the VLAN with
    ``flags`` (PVID, untagged), as RTM_DELLINK it removes it, as ``bridge vlan add/del`` do."""
    spec = [("IFLA_BRIDGE_VLAN_INFO", {"flags": flags, "vid": vid})]
    return link_msg(index, [("IFLA_AF_SPEC", spec)], family=socket.AF_BRIDGE)


def link_kind(msg: LinkMsg) -> str:
    kind = msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND")
    return str(kind) if kind else ""


def random_mac() -> str:
    """A random locally administered unicast MAC address."""
    b = bytearray(os.urandom(6))
    b[0] = (b[0] & 0xFE) | 0x02
    return ":".join(f"{x:02x}" for x in b)


# ---------------------------------------------------------------- addresses


def addr_msg(index: int, iface: IPIface, for_add: bool = True) -> AddrMsg:
    """An address message for ``iface`` on link ``index``. For an add: the broadcast address on IPv4 (as ip(8) and
    the Go netlink library set it) and no DAD on IPv6 (the address is usable at once)."""
    msg = AddrMsg(family=AF_INET if iface.version == 4 else AF_INET6, prefixlen=iface.network.prefixlen, index=index)
    ip = str(iface.ip)
    attrs: list[Attr] = [("IFA_ADDRESS", ip)]
    if iface.version == 4:
        attrs.append(("IFA_LOCAL", ip))
        if for_add and iface.network.prefixlen < 31:
            attrs.append(("IFA_BROADCAST", str(iface.network.broadcast_address)))
    elif for_add:
        msg["flags"] = IFA_F_NODAD  # the header's 8 bits and IFA_FLAGS (32 bits): kernels read the attribute first
        attrs.append(("IFA_FLAGS", IFA_F_NODAD))
    msg["attrs"] = attrs
    return msg


def add_addr(nl: Rtnl, index: int, iface: IPIface) -> None:
    """Add ``iface`` to link ``index``: NetlinkError EEXIST when it is already there."""
    nl.ack(addr_msg(index, iface), RTM_NEWADDR, CREATE)


def del_addr(nl: Rtnl, index: int, iface: IPIface) -> None:
    nl.ack(addr_msg(index, iface, for_add=False), RTM_DELADDR)


def addresses(nl: Rtnl, index: int) -> list[IPIface]:
    """The addresses on link ``index`` as interfaces (address/prefix)."""
    out: list[IPIface] = []
    for msg in nl.dump(AddrMsg(), RTM_GETADDR, AddrMsg):
        if msg["index"] != index:
            continue
        a = msg.get("IFA_ADDRESS")
        if a:
            out.append(ipaddress.ip_interface(f"{a}/{msg['prefixlen']}"))
    return out


# ---------------------------------------------------------------- routes


def route_msg(route: Route, index: int, onlink: bool = False) -> RouteMsg:
    """A route message adding ``route`` out of link ``index``: via ``route.gw`` (``onlink``: a gateway no address of the
    link covers), or a link route (scope link) without one; ``mtu``/``advmss`` as route metrics; ``priority``,
    ``table`` and ``scope`` as given."""
    msg = RouteMsg()
    if onlink and route.gw is not None:
        msg["flags"] = RTNH_F_ONLINK
    msg["family"] = AF_INET if route.dst.version == 4 else AF_INET6
    msg["dst_len"] = route.dst.prefixlen
    # the header's table is 8 bits; a table named in the config also goes in RTA_TABLE, which the kernel reads first
    msg["table"] = route.table if route.table is not None and route.table < 256 else RT_TABLE_MAIN
    msg["proto"] = RTPROT_STATIC
    msg["type"] = RTN_UNICAST
    if route.scope is not None:
        msg["scope"] = route.scope
    else:
        msg["scope"] = RT_SCOPE_UNIVERSE if route.gw is not None else RT_SCOPE_LINK
    attrs: list[Attr] = [("RTA_OIF", index)]
    if route.table is not None:
        attrs.append(("RTA_TABLE", route.table))
    if route.dst.prefixlen:
        attrs.append(("RTA_DST", str(route.dst.network_address)))
    if route.gw is not None:
        attrs.append(("RTA_GATEWAY", str(route.gw)))
    if route.priority is not None:
        attrs.append(("RTA_PRIORITY", route.priority))
    metrics: list[Attr] = []
    if route.mtu:
        metrics.append(("RTAX_MTU", route.mtu))
    if route.advmss:
        metrics.append(("RTAX_ADVMSS", route.advmss))
    if metrics:
        attrs.append(("RTA_METRICS", metrics))
    msg["attrs"] = attrs
    return msg


def add_route(nl: Rtnl, route: Route, index: int, onlink: bool = False) -> None:
    """Add ``route``: NetlinkError EEXIST when the table already has a route to its destination."""
    nl.ack(route_msg(route, index, onlink), RTM_NEWROUTE, CREATE)


def routes(nl: Rtnl, family: int) -> list[RouteMsg]:
    """Every route of ``family`` in the socket's netns, all tables."""
    return nl.dump(RouteMsg(family=family), RTM_GETROUTE, RouteMsg)


# ---------------------------------------------------------------- neighbours


def neigh_msg(index: int, ip: Any, mac: str = "", proxy: bool = False) -> NeighMsg:
    """A neighbour message for ``ip`` on link ``index``; with ``mac``, a permanent entry mapping it there;
    ``proxy``: a proxy entry (the link answers for ``ip``)."""
    msg = NeighMsg(
        family=AF_INET if ip.version == 4 else AF_INET6,
        ifindex=index,
        state=NUD_PERMANENT,
        flags=NTF_PROXY if proxy else 0,
    )
    attrs: list[Attr] = [("NDA_DST", str(ip))]
    if mac:
        attrs.append(("NDA_LLADDR", mac))
    msg["attrs"] = attrs
    return msg


def add_proxy(nl: Rtnl, index: int, ip: Any) -> None:
    """Link ``index`` answers neighbour solicitations for ``ip`` (an existing entry is kept)."""
    nl.ack(neigh_msg(index, ip, proxy=True), RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE)


def del_proxy(nl: Rtnl, index: int, ip: Any) -> bool:
    """Remove the proxy entry for ``ip`` on link ``index``; False when there was none."""
    try:
        nl.ack(neigh_msg(index, ip, proxy=True), RTM_DELNEIGH)
    except NetlinkError as e:
        if e.code in (errno.ENOENT, errno.ENODEV):
            return False
        raise
    return True


def proxies(nl: Rtnl, index: int) -> list[Any]:
    """The IPv6 addresses link ``index`` answers for (its proxy neighbour entries)."""
    request = NeighMsg(family=AF_INET6, flags=NTF_PROXY)
    return [
        ipaddress.ip_address(str(msg.get("NDA_DST")))
        for msg in nl.dump(request, RTM_GETNEIGH, NeighMsg)
        if msg["ifindex"] == index and int(msg["flags"]) & NTF_PROXY and msg.get("NDA_DST")
    ]


def neighbours(nl: Rtnl, index: int) -> dict[str, tuple[str, int]]:
    """``{address: (MAC, NUD state)}`` of the neighbour entries of link ``index``."""
    out: dict[str, tuple[str, int]] = {}
    for family in (AF_INET, AF_INET6):
        for msg in nl.dump(NeighMsg(family=family), RTM_GETNEIGH, NeighMsg):
            if msg["ifindex"] == index and msg.get("NDA_DST"):
                out[str(msg.get("NDA_DST"))] = (str(msg.get("NDA_LLADDR") or ""), int(msg["state"]))
    return out
