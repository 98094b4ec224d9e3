"""The cluster network's light reading of route and neighbour dump answers agrees with what pyroute2 (a development
dependency) encodes, and never raises on bytes that are not a well-formed answer."""

from __future__ import annotations

import ipaddress
import socket

from hypothesis import given, settings
from hypothesis import strategies as st
from pyroute2.netlink.rtnl.ndmsg import ndmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from cni.cluster import rawnl


def encoded(msg: object) -> bytes:
    msg["header"]["type"] = 24  # type: ignore[index]
    msg.encode()  # type: ignore[attr-defined]
    return bytes(msg.data)  # type: ignore[attr-defined]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(
        [(socket.AF_INET, "10.244.{}.0", "192.168.77.{}"), (socket.AF_INET6, "fd44:0:0:{:x}::", "fd77::{:x}")]
    ),
    st.integers(1, 250),
    st.integers(8, 30),
    st.integers(0, 255),
    st.sampled_from([254, 100, 1000]),
    st.one_of(st.none(), st.integers(1, 1 << 20)),
)
def test_a_route_reads_as_pyroute2_decodes_it(
    shape: tuple[int, str, str], i: int, dst_len: int, proto: int, table: int, oif: int | None
) -> None:
    family, dst, gw = shape
    msg = rtmsg()
    msg["family"], msg["dst_len"], msg["proto"], msg["type"] = family, dst_len, proto, 1
    msg["table"] = min(table, 252)
    attrs = [("RTA_DST", dst.format(i)), ("RTA_GATEWAY", gw.format(i)), ("RTA_TABLE", table)]
    msg["attrs"] = attrs + ([("RTA_OIF", oif)] if oif is not None else [])
    got = rawnl.route(encoded(msg))
    assert got == rawnl.Route(family, dst_len, table, proto, 1, ipaddress.ip_address(dst.format(i)),
                              ipaddress.ip_address(gw.format(i)), oif)  # fmt: skip


def test_a_neighbour_and_an_fdb_entry_read_as_written() -> None:
    msg = ndmsg()
    msg["family"], msg["ifindex"], msg["state"] = socket.AF_BRIDGE, 7, 0x80
    msg["attrs"] = [("NDA_DST", "192.168.78.4"), ("NDA_LLADDR", "02:00:00:00:00:04")]
    got = rawnl.neighbour(encoded(msg))
    assert got == rawnl.Neighbour(socket.AF_BRIDGE, 7, 0x80, ipaddress.ip_address("192.168.78.4"), "02:00:00:00:00:04")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_give_an_answer_or_none_and_never_raise(data: bytes) -> None:
    r, n = rawnl.route(data), rawnl.neighbour(data)
    assert r is None or isinstance(r, rawnl.Route)
    assert n is None or isinstance(n, rawnl.Neighbour)
    assert (r is None) == (len(data) < 28) and (n is None) == (len(data) < 28)
