"""The rtnetlink messages of :mod:`cni.dataplane.messages`: what is encoded decodes back to the same values, and no
bytes (the kernel's answers are read, never trusted) make the decoder raise anything but the documented ValueError
of a body too short for its header. The comparison with pyroute2's encoding is in test_cni_rtnl.py (requests) and
tests/node/test_cni_rtnl_kernel.py (the kernel's own answers)."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cni.dataplane.messages import AddrMsg, LinkMsg, Message, NeighMsg, Nested, RouteMsg

CLASSES: list[type[Message]] = [LinkMsg, AddrMsg, RouteMsg, NeighMsg]

names = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=15)
macs = st.binary(min_size=6, max_size=6).map(lambda b: ":".join(f"{x:02x}" for x in b))
u32 = st.integers(0, 0xFFFFFFFF)
ipv4 = st.builds(lambda n: str(ipaddress.IPv4Address(n)), st.integers(0, 2**32 - 1))
ipv6 = st.builds(lambda n: str(ipaddress.IPv6Address(n)), st.integers(0, 2**128 - 1))


def roundtrip(msg: Message) -> Message:
    data = msg.encode(16, 5, 9)
    length, msg_type, flags, seq, pid = struct.unpack_from("=IHHII", data)
    assert (length, msg_type, flags, seq, pid) == (len(data), 16, 5, 9, 0) and len(data) % 4 == 0
    return type(msg).decode(data)


@settings(max_examples=200, deadline=None)
@given(names, names, macs, macs, u32, st.integers(0, 0x7FFFFFFF), st.integers(68, 65535), st.text(max_size=40))
def test_a_veth_request_decodes_to_what_was_encoded(
    name: str, peer: str, mac: str, peer_mac: str, master: int, index: int, mtu: int, alias: str
) -> None:
    alias = alias.replace("\0", "")
    msg = LinkMsg(index=index, flags=1, change=1)
    peer_attrs = [("IFLA_IFNAME", peer), ("IFLA_NET_NS_FD", 9), ("IFLA_ADDRESS", peer_mac), ("IFLA_MTU", mtu)]
    msg["attrs"] = [
        ("IFLA_IFNAME", name),
        ("IFLA_ADDRESS", mac),
        ("IFLA_MASTER", master),
        ("IFLA_IFALIAS", alias),
        (
            "IFLA_LINKINFO",
            [("IFLA_INFO_KIND", "veth"), ("IFLA_INFO_DATA", [("VETH_INFO_PEER", {"attrs": peer_attrs})])],
        ),
    ]
    back = roundtrip(msg)
    assert back["index"] == index and back["flags"] == 1 and back["change"] == 1
    assert (back.get("IFLA_IFNAME"), back.get("IFLA_ADDRESS"), back.get("IFLA_MASTER")) == (name, mac, master)
    assert back.get("IFLA_IFALIAS") == alias
    got_peer = back.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA", "VETH_INFO_PEER")
    assert isinstance(got_peer, LinkMsg) and got_peer.attrs == peer_attrs
    assert back.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND") == "veth"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**24 - 1), st.integers(1, 65535), st.one_of(ipv4, ipv6), u32, st.sampled_from([0, 1]))
def test_vxlan_data_decodes_to_what_was_encoded(vni: int, port: int, local: str, link: int, learning: int) -> None:
    data = [
        ("IFLA_VXLAN_ID", vni),
        ("IFLA_VXLAN_LOCAL6" if ":" in local else "IFLA_VXLAN_LOCAL", local),
        ("IFLA_VXLAN_LINK", link),
        ("IFLA_VXLAN_PORT", port),
        ("IFLA_VXLAN_LEARNING", learning),
    ]
    msg = LinkMsg()
    msg["attrs"] = [("IFLA_LINKINFO", [("IFLA_INFO_KIND", "vxlan"), ("IFLA_INFO_DATA", data)])]
    got = roundtrip(msg).get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA")
    assert isinstance(got, Nested) and got.attrs == data


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(st.tuples(st.just(socket.AF_INET), ipv4, ipv4), st.tuples(st.just(socket.AF_INET6), ipv6, ipv6)),
    st.integers(0, 128),
    u32,
    u32,
    st.lists(st.sampled_from(["RTAX_MTU", "RTAX_ADVMSS"]), unique=True).flatmap(
        lambda keys: st.tuples(*(st.tuples(st.just(k), u32) for k in keys))
    ),
)
def test_a_route_decodes_to_what_was_encoded(
    addrs: tuple[int, str, str], dst_len: int, table: int, priority: int, metrics: tuple[tuple[str, int], ...]
) -> None:
    family, dst, gw = addrs
    msg = RouteMsg(family=family, dst_len=min(dst_len, 32 if family == socket.AF_INET else 128), table=254, proto=4)
    attrs = [("RTA_DST", dst), ("RTA_GATEWAY", gw), ("RTA_TABLE", table), ("RTA_PRIORITY", priority), ("RTA_OIF", 3)]
    if metrics:
        attrs.append(("RTA_METRICS", list(metrics)))
    msg["attrs"] = attrs
    back = roundtrip(msg)
    assert back.fields == msg.fields
    assert [(n, v.attrs if isinstance(v, Nested) else v) for n, v in back.attrs] == [
        (n, list(v) if n == "RTA_METRICS" else v) for n, v in attrs
    ]


def test_addresses_neighbours_and_a_bridge_vlan_encode_as_the_kernel_reads_them() -> None:
    addr = AddrMsg(family=socket.AF_INET, prefixlen=24, index=3)
    addr["attrs"] = [("IFA_ADDRESS", "10.0.0.5"), ("IFA_LOCAL", "10.0.0.5"), ("IFA_BROADCAST", "10.0.0.255")]
    assert roundtrip(addr).attrs == addr.attrs
    neigh = NeighMsg(family=socket.AF_BRIDGE, ifindex=7, state=0x80, flags=2)
    neigh["attrs"] = [("NDA_DST", "fd77::4"), ("NDA_LLADDR", "02:00:00:00:00:04")]
    back = roundtrip(neigh)
    assert back.fields == {"family": socket.AF_BRIDGE, "ifindex": 7, "state": 0x80, "flags": 2, "ndm_type": 0}
    assert back.attrs == neigh.attrs
    vlan = LinkMsg(family=socket.AF_BRIDGE, index=5)
    vlan["attrs"] = [("IFLA_AF_SPEC", [("IFLA_BRIDGE_VLAN_INFO", {"flags": 6, "vid": 100})])]
    data = vlan.encode(19)
    # ifinfomsg, then IFLA_AF_SPEC (26) holding IFLA_BRIDGE_VLAN_INFO (2): flags 6, vid 100
    assert data[32:] == struct.pack("=HHHHHH", 12, 26, 8, 2, 6, 100)


def test_an_attribute_or_header_field_nobody_knows_is_refused_by_name() -> None:
    msg = LinkMsg()
    msg["attrs"] = [("IFLA_NO_SUCH_THING", 1)]
    with pytest.raises(ValueError, match="IFLA_NO_SUCH_THING"):
        msg.encode(16)
    with pytest.raises(KeyError, match="dst_len"):
        msg["dst_len"] = 3
    info = LinkMsg()
    info["attrs"] = [("IFLA_LINKINFO", [("IFLA_INFO_KIND", "macvlan"), ("IFLA_INFO_DATA", [("X", 1)])])]
    with pytest.raises(ValueError, match="IFLA_INFO_DATA"):
        info.encode(16)


def _attr(number: int, value: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(value), number) + value + b"\0" * (-len(value) % 4)


# attribute numbers the tables know (and a few they do not), with any payload: the decoder's paths for every codec
attr_numbers = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 15, 18, 20, 26, 28, 29, 0x8012, 0x8008, 99, 0x3FFF])
payloads = st.one_of(
    st.binary(max_size=24),
    st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 5, 7, 15, 17]), st.binary(max_size=20)), max_size=4).map(
        lambda inner: b"".join(_attr(n, v) for n, v in inner)
    ),
)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(CLASSES), st.binary(max_size=20), st.lists(st.tuples(attr_numbers, payloads), max_size=8))
def test_any_answer_decodes_or_is_a_value_error_for_a_short_header(
    cls: type[Message], header: bytes, attrs: list[tuple[int, bytes]]
) -> None:
    body = header + b"".join(_attr(n, v) for n, v in attrs)
    data = struct.pack("=IHHII", 16 + len(body), 16, 0, 1, 0) + body
    if len(header) < cls.HEADER.size and not attrs:
        with pytest.raises(ValueError, match="too short"):
            cls.decode(data)
        return
    try:
        msg = cls.decode(data)
    except ValueError as e:
        assert "too short" in str(e)
        return
    assert set(msg.fields) == set(cls.FIELDS)
    for name, _ in msg.attrs:
        assert name in cls.TABLE.by_name


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CLASSES), st.binary(max_size=120))
def test_any_bytes_at_all_decode_or_are_a_value_error(cls: type[Message], data: bytes) -> None:
    try:
        msg = cls.decode(data, with_header=False)
    except ValueError:
        assert len(data) < cls.HEADER.size
        return
    assert isinstance(msg, cls)
