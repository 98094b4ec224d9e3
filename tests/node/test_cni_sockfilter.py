"""Socket filters on netlink multicast sockets against the real kernel, in a network namespace of its own: a listener
sees exactly the events its program keeps, and is not woken for the others."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable

import pytest

from cni.dataplane import sockfilter
from cni.dataplane.netns import entered
from cni.dataplane.nlwire import messages
from cni.dataplane.rtnl import RTM_DELLINK, RTM_DELROUTE, RTM_NEWLINK

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and links")

RTMGRP_LINK, RTMGRP_IPV4_ROUTE = 0x1, 0x40


def listener(ns: str, groups: int, program: list[sockfilter.Insn] | None) -> socket.socket:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        with entered(fd):
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
    finally:
        os.close(fd)
    if program is not None:
        assert sockfilter.attach(sock, program)
    sock.bind((0, groups))
    return sock


def drain(sock: socket.socket) -> list[int]:
    """The types of the events queued on ``sock`` (the changes that made them have returned already)."""
    sock.setblocking(False)
    types: list[int] = []
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return types
        types += [msg_type for msg_type, _, _, _ in messages(data)]


def test_a_listener_gets_only_the_types_its_program_keeps(netns: Callable[[], str]) -> None:
    ns = netns()
    kept = listener(ns, RTMGRP_LINK | RTMGRP_IPV4_ROUTE, sockfilter.types_only([RTM_DELLINK, RTM_DELROUTE]))
    everything = listener(ns, RTMGRP_LINK | RTMGRP_IPV4_ROUTE, None)
    with kept, everything:
        for cmd in ("link add npf0 type bridge", "link set npf0 up", "addr add 10.66.0.1/24 dev npf0",
                    "route add 10.67.0.0/16 via 10.66.0.2", "route del 10.67.0.0/16", "link del npf0"):  # fmt: skip
            subprocess.run(["ip", "-n", ns, *cmd.split()], check=True)
        seen = drain(everything)
        assert RTM_NEWLINK in seen and seen.count(RTM_DELROUTE) >= 1  # the unfiltered one saw it all
        got = drain(kept)
        assert set(got) == {RTM_DELLINK, RTM_DELROUTE} and got.count(RTM_DELROUTE) == seen.count(RTM_DELROUTE)
        assert got.count(RTM_DELLINK) == seen.count(RTM_DELLINK)


def test_a_program_keeping_one_type_drops_every_other(netns: Callable[[], str]) -> None:
    """The last type of the list and the first are kept alike (the jumps to KEEP count right)."""
    ns = netns()
    for types in ([RTM_NEWLINK], [RTM_DELROUTE, RTM_NEWLINK]):
        with listener(ns, RTMGRP_LINK, sockfilter.types_only(types)) as sock:
            subprocess.run(["ip", "-n", ns, "link", "add", "npf1", "type", "bridge"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "del", "npf1"], check=True)
            got = drain(sock)
            assert got and set(got) == {RTM_NEWLINK}, (types, got)
