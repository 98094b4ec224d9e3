"""The rtnetlink transport against the real kernel, each test in a network namespace of its own: dumps that span many
datagrams, errors that carry the kernel's own message, and a socket that keeps talking to the netns it was opened in."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from cni.dataplane import nl
from cni.dataplane.messages import AddrMsg, LinkMsg, Message, NeighMsg, Nested, RouteMsg
from cni.dataplane.netns import entered
from cni.dataplane.rtnl import RTM_GETADDR, RTM_GETLINK, RTM_GETNEIGH, RTM_GETROUTE, NetlinkError, Rtnl
from cni.types import Route

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and links")


@contextmanager
def socket_in(name: str) -> Iterator[Rtnl]:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        with entered(fd):
            sock = Rtnl()
    finally:
        os.close(fd)
    try:
        yield sock
    finally:
        sock.close()


def test_a_link_dump_spanning_many_datagrams_returns_every_link(netns: Callable[[], str]) -> None:
    ns = netns()
    count = 60  # a dump datagram holds a few links: this takes many
    batch = "".join(f"link add npd{i} type bridge\n" for i in range(count))
    subprocess.run(["ip", "-n", ns, "-batch", "-"], input=batch, text=True, check=True, capture_output=True)
    with socket_in(ns) as sock:
        names = {msg.get("IFLA_IFNAME") for msg in nl.links(sock)}
        assert names == {"lo", *(f"npd{i}" for i in range(count))}
        # the socket is still in step afterwards: the next request gets its own answer
        found = nl.get_link(sock, f"npd{count - 1}")
        assert found is not None and nl.link_kind(found) == "bridge"


def test_errors_carry_the_errno_and_the_kernel_s_message(netns: Callable[[], str]) -> None:
    ns = netns()
    subprocess.run(["ip", "-n", ns, "link", "add", "npe0", "type", "bridge"], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "npe0", "up"], check=True)
    with socket_in(ns) as sock:
        index = nl.get_link(sock, "npe0")["index"]
        unreachable = Route(ipaddress.ip_network("10.77.0.0/16"), ipaddress.ip_address("192.0.2.1"))
        with pytest.raises(NetlinkError) as e:
            nl.add_route(sock, unreachable, index)  # no address on npe0: the gateway is not on any of its networks
        assert e.value.code == errno.ENETUNREACH
        text = str(e.value.args[1])
        assert text.startswith(os.strerror(errno.ENETUNREACH)) and len(text) > len(os.strerror(errno.ENETUNREACH)), (
            f"no extended ACK message from the kernel: {text!r}"
        )
        assert nl.nl_error("add route 10.77.0.0/16", e.value).details == f"add route 10.77.0.0/16: {text}"
        # a missing link is ENODEV for get_link's caller to see as "absent", not an error
        assert nl.get_link(sock, "npe-missing") is None
        with pytest.raises(NetlinkError) as gone:
            nl.create_link(sock, [("IFLA_IFNAME", "npe0"), nl.linkinfo("bridge")])
        assert gone.value.code == errno.EEXIST


def test_a_socket_keeps_talking_to_the_netns_it_was_opened_in(netns: Callable[[], str]) -> None:
    """The thread has left the netns before the request is sent: the link must still appear there, not in the
    thread's own netns (nor in any other)."""
    a, b = netns(), netns()
    with socket_in(a) as sock:
        nl.create_link(sock, [("IFLA_IFNAME", "npk0"), nl.linkinfo("bridge")])
    listed_a = subprocess.run(["ip", "-n", a, "-br", "link"], capture_output=True, text=True, check=True).stdout
    listed_b = subprocess.run(["ip", "-n", b, "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert "npk0" in listed_a and "npk0" not in listed_b
    with pytest.raises(OSError):
        socket.if_nametoindex("npk0")  # this thread's (the test's own) netns has no such link


def _same(ours: Any, theirs: Any, where: str) -> None:
    """Every attribute our decoder reads agrees with pyroute2's decoding of the same bytes, nested ones included."""
    if isinstance(ours, Nested):
        assert theirs is not None, f"{where}: pyroute2 has nothing"
        for name, value in ours.attrs:
            _same(value, theirs.get_attr(name), f"{where}.{name}")
        for field, value in getattr(ours, "fields", {}).items():
            assert theirs[field] == value, f"{where}[{field}]: {value!r} != {theirs[field]!r}"
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def test_the_kernel_s_answers_decode_as_pyroute2_decodes_them(netns: Callable[[], str]) -> None:
    """Links of every kind nodeplug makes or reads (a bridge, a veth pair with a hairpin bridge
    port, VXLAN over IPv4 and IPv6), addresses, routes with metrics and tables, neighbour, proxy and FDB entries: as
    the kernel reports them, read by :mod:`cni.dataplane.messages` and by pyroute2 (a development dependency here)."""
    from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
    from pyroute2.netlink.rtnl.ndmsg import ndmsg
    from pyroute2.netlink.rtnl.rtmsg import rtmsg

    ns = netns()
    script = """\
link add npx0 type bridge
link set npx0 alias nodeplug-test up
link add npx1 mtu 1400 type veth peer name npx2
link set npx1 master npx0 up
link set npx1 type bridge_slave hairpin on
link set npx2 up
addr add 10.78.0.1/24 dev npx0
addr add fd78::1/64 dev npx0 nodad
link add npx3 type vxlan id 42 local 10.78.0.1 dev npx0 dstport 4789 nolearning
link add npx4 type vxlan id 43 local fd78::1 dev npx0 dstport 4790
link set npx3 up
route add 10.79.0.0/16 via 10.78.0.2 dev npx0 mtu 1300 advmss 1200 metric 7 proto 110
route add 10.80.0.0/16 dev npx0 table 1000
route add fd79::/64 via fd78::2 dev npx0 proto 110
neigh add 10.78.0.9 lladdr 02:00:00:00:00:09 dev npx0 nud permanent
neigh add proxy fd78::9 dev npx0
"""
    subprocess.run(["ip", "-n", ns, "-batch", "-"], input=script, text=True, check=True, capture_output=True)
    fdb = ["bridge", "-n", ns, "fdb", "append", "00:00:00:00:00:00", "dev", "npx3", "dst", "192.0.2.7", "self"]
    subprocess.run([*fdb, "permanent"], check=True, capture_output=True)
    with socket_in(ns) as sock:
        requests: list[tuple[str, Message, int, type[Message], Any]] = [
            ("link", nl.link_msg(), RTM_GETLINK, LinkMsg, ifinfmsg),
            ("address", AddrMsg(), RTM_GETADDR, AddrMsg, ifaddrmsg),
            ("route", RouteMsg(family=socket.AF_INET), RTM_GETROUTE, RouteMsg, rtmsg),
            ("route", RouteMsg(family=socket.AF_INET6), RTM_GETROUTE, RouteMsg, rtmsg),
            ("neighbour", NeighMsg(family=socket.AF_INET), RTM_GETNEIGH, NeighMsg, ndmsg),
            ("proxy", NeighMsg(family=socket.AF_INET6, flags=nl.NTF_PROXY), RTM_GETNEIGH, NeighMsg, ndmsg),
            ("fdb", NeighMsg(family=socket.AF_BRIDGE), RTM_GETNEIGH, NeighMsg, ndmsg),
        ]
        seen: set[str] = set()
        for what, request, msg_type, ours_cls, theirs_cls in requests:
            for data in sock.dump_raw(request, msg_type):
                ours = ours_cls.decode(data)
                theirs = theirs_cls(data)
                theirs.decode()
                _same(ours, theirs, f"{what} {ours.fields}")
                seen.update(name for name, _ in ours.attrs)
                info = ours.get("IFLA_LINKINFO")
                if info is not None:
                    seen.update(name for name, _ in info.attrs)
                    for name in ("IFLA_INFO_DATA", "IFLA_INFO_SLAVE_DATA"):
                        seen.update(n for n, _ in (info.get(name) or Nested()).attrs)
                metrics = ours.get("RTA_METRICS")
                if metrics is not None:
                    seen.update(name for name, _ in metrics.attrs)
        bridge, vx4, vx6 = (nl.get_link(sock, name) for name in ("npx0", "npx3", "npx4"))
    # what the dataplane and the cluster network read was there to be compared
    assert {"IFLA_IFNAME", "IFLA_ADDRESS", "IFLA_MTU", "IFLA_MASTER", "IFLA_IFALIAS", "IFLA_INFO_KIND",
            "IFLA_INFO_SLAVE_KIND", "IFLA_BRPORT_MODE", "IFLA_VXLAN_ID", "IFLA_VXLAN_PORT",
            "IFLA_VXLAN_LOCAL", "IFLA_VXLAN_LOCAL6", "IFLA_VXLAN_LINK", "IFLA_VXLAN_LEARNING", "IFA_ADDRESS",
            "IFA_LOCAL", "IFA_FLAGS", "RTA_DST", "RTA_GATEWAY", "RTA_OIF", "RTA_TABLE", "RTA_PRIORITY", "RTAX_MTU",
            "RTAX_ADVMSS", "NDA_DST", "NDA_LLADDR"} <= seen, seen  # fmt: skip
    assert bridge is not None and bridge.get("IFLA_IFALIAS") == "nodeplug-test"
    assert bridge.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA").get("IFLA_BR_VLAN_FILTERING") in (0, None)
    assert vx4 is not None and vx4.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA").get("IFLA_VXLAN_PORT") == 4789
    assert vx6 is not None and vx6.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA").get("IFLA_VXLAN_LOCAL6") == "fd78::1"
