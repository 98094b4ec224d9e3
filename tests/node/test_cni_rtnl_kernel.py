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

import pytest

from cni.dataplane import nl
from cni.dataplane.netns import entered
from cni.dataplane.rtnl import NetlinkError, Rtnl
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
