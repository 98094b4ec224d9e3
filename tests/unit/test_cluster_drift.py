"""cni.cluster.drift: which kernel events call for a full pass of the cluster network, read from the bytes the
kernel multicasts (built here as the kernel lays them out); and nothing in a datagram makes the reader raise."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from cni.cluster.drift import drift_in, pod_links_in
from cni.dataplane.names import BRIDGE_ALIAS
from cni.dataplane.rtnl import RTM_DELLINK, RTM_DELNEIGH, RTM_DELROUTE, RTM_NEWLINK, RTM_NEWROUTE

PROTO = 110


def message(msg_type: int, body: bytes) -> bytes:
    body += b"\0" * (-len(body) % 4)
    return struct.pack("=IHHII", 16 + len(body), msg_type, 0, 0, 0) + body


def route(msg_type: int, protocol: int) -> bytes:
    return message(msg_type, struct.pack("=BBBBBBBBI", 2, 24, 0, 0, 254, protocol, 0, 1, 0))


def attr(kind: int, text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("=HH", 4 + len(raw), kind) + raw + b"\0" * (-len(raw) % 4)


def link(msg_type: int, name: str, alias: str = "") -> bytes:
    attrs = attr(3, name) + (attr(20, alias) if alias else b"")
    return message(msg_type, struct.pack("=BBHiII", 0, 0, 1, 7, 0, 0) + attrs)


def neigh(msg_type: int, ifindex: int) -> bytes:
    return message(msg_type, struct.pack("=BBHiHBB", 7, 0, 0, ifindex, 0x80, 0, 0))


def test_a_route_of_ours_deleted_calls_for_a_pass_and_others_do_not() -> None:
    assert drift_in(route(RTM_DELROUTE, PROTO), PROTO, lambda: None)
    assert not drift_in(route(RTM_DELROUTE, 4), PROTO, lambda: None)  # someone else's
    assert not drift_in(route(RTM_NEWROUTE, PROTO), PROTO, lambda: None)


def test_devices_but_pod_veths_call_for_a_pass() -> None:
    for msg_type in (RTM_NEWLINK, RTM_DELLINK):
        assert "eth0" in drift_in(link(msg_type, "eth0"), PROTO, lambda: None)
        assert drift_in(link(msg_type, "nodeplug.vx"), PROTO, lambda: None)
        assert not drift_in(link(msg_type, "veth0123abcd"), PROTO, lambda: None)  # a pod's, with every ADD and DEL
    assert drift_in(link(RTM_NEWLINK, "vethernet"), PROTO, lambda: None)  # not a pod veth's name
    # the pod bridge and a pod's veth, whatever their names, changing as pods come and go
    assert not drift_in(link(RTM_NEWLINK, "cni0", BRIDGE_ALIAS), PROTO, lambda: None)
    assert not drift_in(link(RTM_NEWLINK, "p1", "nodeplug kubenet eth0 c1 +nomasq"), PROTO, lambda: None)
    assert drift_in(link(RTM_NEWLINK, "br0", "uplink"), PROTO, lambda: None)


def test_an_entry_deleted_on_the_vxlan_device_calls_for_a_pass() -> None:
    assert drift_in(neigh(RTM_DELNEIGH, 9), PROTO, lambda: 9)
    assert not drift_in(neigh(RTM_DELNEIGH, 3), PROTO, lambda: 9)
    assert not drift_in(neigh(RTM_DELNEIGH, 9), PROTO, lambda: None)  # no VXLAN device


def test_one_event_among_others_in_a_datagram_is_found() -> None:
    data = link(RTM_NEWLINK, "veth0123abcd") + route(RTM_DELROUTE, 4) + route(RTM_DELROUTE, PROTO)
    assert drift_in(data, PROTO, lambda: None) == "a route of ours was deleted"


@given(st.binary(max_size=600), st.integers(0, 255))
def test_no_datagram_makes_it_raise(data: bytes, protocol: int) -> None:
    assert isinstance(drift_in(data, protocol, lambda: 7), str)


@given(st.lists(st.sampled_from([RTM_DELROUTE, RTM_NEWLINK, RTM_DELLINK, RTM_DELNEIGH]), max_size=4),
       st.binary(max_size=80))  # fmt: skip
def test_truncated_and_garbled_events_do_not_make_it_raise(types: list[int], body: bytes) -> None:
    data = b"".join(message(t, body) for t in types)
    for cut in range(0, len(data), 7):
        assert isinstance(drift_in(data[:cut], PROTO, lambda: 7), str)


def test_pod_veths_and_the_pod_bridge_coming_and_going_are_told_apart_for_the_redirect() -> None:
    for msg_type in (RTM_NEWLINK, RTM_DELLINK):
        assert pod_links_in(link(msg_type, "veth0123abcd"))
        assert pod_links_in(link(msg_type, "cni0", BRIDGE_ALIAS))
        assert not pod_links_in(link(msg_type, "eth0"))
    assert not pod_links_in(route(RTM_DELROUTE, PROTO))
    assert pod_links_in(route(RTM_DELROUTE, PROTO) + link(RTM_NEWLINK, "veth0123abcd"))  # anywhere in the datagram


@given(st.binary(max_size=512))
def test_any_datagram_is_read_without_raising_for_the_redirect(data: bytes) -> None:
    assert pod_links_in(data) in (True, False)
