"""The rtnetlink transport's pure parts, and every request the dataplane builds compared byte for byte with what
pyroute2's own request layer (``IPBatch``: encodes, never sends) puts on the wire for the same operation (pyroute2
is a development dependency for this: the product encodes with :mod:`cni.dataplane.messages`)."""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from cni.dataplane import nl
from cni.dataplane.messages import LinkMsg
from cni.dataplane.nlwire import NLMSG_DONE, NLMSG_ERROR
from cni.dataplane.nlwire import messages as parse
from cni.dataplane.rtnl import RTM_DELLINK, RTM_NEWADDR, RTM_NEWLINK, error_of
from cni.types import Route

NLM_F_CAPPED = 0x100
NLM_F_ACK_TLVS = 0x200


def _nlmsg(msg_type: int, payload: bytes, flags: int = 0, seq: int = 7) -> bytes:
    data = struct.pack("=IHHII", 16 + len(payload), msg_type, flags, seq, 0) + payload
    return data + b"\0" * (-len(data) % 4)


def _attr(attr_type: int, value: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(value), attr_type) + value
    return data + b"\0" * (-len(data) % 4)


def _error(code: int, flags: int = 0, request_body: bytes = b"", tlvs: bytes = b"") -> bytes:
    request = struct.pack("=IHHII", 16 + len(request_body), RTM_NEWLINK, 5, 7, 0) + request_body
    request += b"\0" * (-len(request) % 4)  # the echoed request is padded like any message
    return _nlmsg(NLMSG_ERROR, struct.pack("=i", -code) + request + tlvs, flags)


# ---------------------------------------------------------------- parsing answers


def test_parse_splits_a_datagram_into_messages_and_stops_at_a_bad_length() -> None:
    datagram = _nlmsg(RTM_NEWLINK, b"abcde") + _nlmsg(NLMSG_DONE, struct.pack("=i", 0), seq=8)
    got = [(t, seq, bytes(m)) for t, _, seq, m in parse(datagram)]
    assert [(t, seq) for t, seq, _ in got] == [(RTM_NEWLINK, 7), (NLMSG_DONE, 8)]
    assert got[0][2].endswith(b"abcde")  # the whole message, header included, padding excluded
    broken = struct.pack("=IHHII", 400, RTM_NEWLINK, 0, 1, 0)  # claims more bytes than there are
    before = _nlmsg(RTM_NEWLINK, b"x", seq=3)
    assert [(t, seq, bytes(m)) for t, _, seq, m in parse(before + broken)] == [(RTM_NEWLINK, 3, before[:17])]
    assert list(parse(broken)) == []


def test_ack_plain_error_and_the_kernel_s_extended_message() -> None:
    assert error_of(0, _error(0)) == (0, "")
    assert error_of(0, _error(errno.EEXIST)) == (errno.EEXIST, "File exists")
    message = _attr(1, b"Nexthop has invalid gateway\0") + _attr(2, struct.pack("=I", 40))
    capped = _error(errno.ENETUNREACH, NLM_F_CAPPED | NLM_F_ACK_TLVS, tlvs=message)
    assert error_of(NLM_F_CAPPED | NLM_F_ACK_TLVS, capped) == (
        errno.ENETUNREACH,
        "Network is unreachable: Nexthop has invalid gateway",
    )
    # without NETLINK_CAP_ACK the failed request comes back whole, and the message follows it
    whole = _error(errno.EINVAL, NLM_F_ACK_TLVS, request_body=b"\1" * 22, tlvs=_attr(1, b"bad prefix\0"))
    assert error_of(NLM_F_ACK_TLVS, whole) == (errno.EINVAL, "Invalid argument: bad prefix")
    # TLVs announced but absent or malformed: the errno's name alone
    assert error_of(NLM_F_CAPPED | NLM_F_ACK_TLVS, _error(errno.EPERM)) == (errno.EPERM, "Operation not permitted")


# ---------------------------------------------------------------- requests, as pyroute2 would encode them


def _tlvs(data: bytes, offset: int) -> list[bytes]:
    """The attributes from ``offset``, each as its bytes (type, length, value and padding)."""
    out = []
    while offset + 4 <= len(data):
        length, _ = struct.unpack_from("=HH", data, offset)
        assert length >= 4 and offset + length <= len(data), f"bad attribute length at {offset}"
        out.append(data[offset : offset + ((length + 3) & ~3)])
        offset += (length + 3) & ~3
    return out


def _canon(data: bytes, header: int) -> dict[str, Any]:
    """A message's bytes without its netlink header: the fixed header, and each attribute's bytes (nested ones
    whole), in sorted order (the two encoders may order attributes differently; the kernel does not mind)."""
    (length,) = struct.unpack_from("=I", data, 0)
    assert length == len(data)
    return {"header": data[16 : 16 + header].hex(), "attrs": sorted(t.hex() for t in _tlvs(data, 16 + header))}


HEADER_SIZE = {"ifinfmsg": 16, "ifaddrmsg": 8, "rtmsg": 12, "ndmsg": 12}


def _ours(msg: Any, msg_type: int) -> bytes:
    return bytes(msg.encode(msg_type))


class _Recorder:
    """Stands in for the netlink socket of a function that builds and sends one request: keeps its bytes."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def ack(self, msg: Any, msg_type: int, flags: int = 0) -> None:
        self.sent.append(bytes(msg.encode(msg_type)))


def _sent_by(call: Callable[[Any], object]) -> bytes:
    rec = _Recorder()
    call(rec)
    assert len(rec.sent) == 1
    return rec.sent[0]


def _pyroute2(call: Callable[[Any], object]) -> bytes:
    from pyroute2 import IPBatch

    batch = IPBatch()
    try:
        call(batch)
        return bytes(batch.batch)
    finally:
        batch.close()


MAC1, MAC2 = "02:00:00:00:00:01", "02:00:00:00:00:02"
V4 = ipaddress.ip_interface("10.0.0.5/24")
V6 = ipaddress.ip_interface("fd00::5/64")


def _cases() -> list[tuple[str, Callable[[], bytes], Callable[[Any], object], str]]:
    from cni.cluster import kernel
    from cni.cluster.plan import RouteSpec
    from cni.dataplane.rtnl import RTM_DELADDR, RTM_NEWNEIGH, RTM_NEWROUTE, RTM_SETLINK

    vx_route = RouteSpec(ipaddress.ip_network("10.244.4.0/24"), ipaddress.ip_address("10.244.4.0"), True)
    gw_route = Route(ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_address("10.0.0.1"), mtu=1400, priority=5)
    link_route = Route(ipaddress.ip_network("10.9.0.0/16"), table=100)
    v6_route = Route(ipaddress.ip_network("fd01::/64"), ipaddress.ip_address("fd00::1"), table=1000, advmss=1200)
    peer = [("IFLA_IFNAME", "eth0"), ("IFLA_NET_NS_FD", 9), ("IFLA_ADDRESS", MAC2), ("IFLA_MTU", 1400)]
    return [
        (
            "bridge",
            lambda: _ours(
                nl.link_msg(attrs=[("IFLA_IFNAME", "br0"), ("IFLA_ADDRESS", MAC1), nl.linkinfo("bridge")]),
                RTM_NEWLINK,
            ),
            lambda b: b.link("add", ifname="br0", kind="bridge", address=MAC1),
            "ifinfmsg",
        ),
        (
            "veth with its peer in a netns",
            lambda: _ours(
                nl.link_msg(
                    attrs=[
                        ("IFLA_IFNAME", "v0"),
                        ("IFLA_ADDRESS", MAC1),
                        ("IFLA_MASTER", 4),
                        ("IFLA_MTU", 1400),
                        nl.linkinfo("veth", [("VETH_INFO_PEER", {"attrs": peer})]),
                    ]
                ),
                RTM_NEWLINK,
            ),
            lambda b: b.link(
                "add",
                ifname="v0",
                kind="veth",
                address=MAC1,
                master=4,
                mtu=1400,
                peer={"ifname": "eth0", "net_ns_fd": 9, "address": MAC2, "mtu": 1400},
            ),
            "ifinfmsg",
        ),
        (
            "bridge VLAN filtering",
            lambda: _ours(nl.link_msg(4, [nl.linkinfo("bridge", [("IFLA_BR_VLAN_FILTERING", 1)])]), RTM_NEWLINK),
            lambda b: b.link("set", index=4, kind="bridge", br_vlan_filtering=1),
            "ifinfmsg",
        ),
        (
            "port VLAN add (pvid, untagged)",
            lambda: _ours(
                nl.port_vlan_msg(5, 100, nl.BRIDGE_VLAN_INFO_PVID | nl.BRIDGE_VLAN_INFO_UNTAGGED), RTM_SETLINK
            ),
            lambda b: b.vlan_filter("add", index=5, vlan_info={"vid": 100, "pvid": True}),
            "ifinfmsg",
        ),
        (
            "port VLAN del",
            lambda: _ours(nl.port_vlan_msg(5, 1, 0), RTM_DELLINK),
            lambda b: b.vlan_filter("del", index=5, vlan_info={"vid": 1}),
            "ifinfmsg",
        ),
        (
            "no IPv6 address generated for a link",
            lambda: _ours(
                nl.link_msg(5, [("IFLA_AF_SPEC", [("AF_INET6", [("IFLA_INET6_ADDR_GEN_MODE", 1)])])]), RTM_NEWLINK
            ),
            lambda b: b.link(
                "set", index=5, IFLA_AF_SPEC={"attrs": [["AF_INET6", {"attrs": [["IFLA_INET6_ADDR_GEN_MODE", 1]]}]]}
            ),
            "ifinfmsg",
        ),
        (
            "delete a link by name",
            lambda: _ours(nl.link_msg(attrs=[("IFLA_IFNAME", "v0")]), RTM_DELLINK),
            lambda b: b.link("del", ifname="v0"),
            "ifinfmsg",
        ),
        (
            "IPv4 address with broadcast",
            lambda: _ours(nl.addr_msg(3, V4), RTM_NEWADDR),
            lambda b: b.addr("add", index=3, address="10.0.0.5", prefixlen=24, broadcast="10.0.0.255"),
            "ifaddrmsg",
        ),
        (
            "IPv4 /31 address, no broadcast",
            lambda: _ours(nl.addr_msg(3, ipaddress.ip_interface("10.0.0.5/31")), RTM_NEWADDR),
            lambda b: b.addr("add", index=3, address="10.0.0.5", prefixlen=31),
            "ifaddrmsg",
        ),
        (
            "IPv4 address removal",
            lambda: _ours(nl.addr_msg(3, V4, for_add=False), RTM_DELADDR),
            lambda b: b.addr("del", index=3, address="10.0.0.5", prefixlen=24),
            "ifaddrmsg",
        ),
        (
            "route via a gateway with mtu and priority",
            lambda: _ours(nl.route_msg(gw_route, 7), RTM_NEWROUTE),
            lambda b: b.route("add", dst="0.0.0.0/0", oif=7, gateway="10.0.0.1", priority=5, metrics={"mtu": 1400}),
            "rtmsg",
        ),
        (
            "link route in table 100",
            lambda: _ours(nl.route_msg(link_route, 7), RTM_NEWROUTE),
            lambda b: b.route("add", dst="10.9.0.0/16", oif=7, scope=253, table=100),
            "rtmsg",
        ),
        (
            "IPv6 route in table 1000 with advmss",
            lambda: _ours(nl.route_msg(v6_route, 7), RTM_NEWROUTE),
            lambda b: b.route("add", dst="fd01::/64", oif=7, gateway="fd00::1", table=1000, metrics={"advmss": 1200}),
            "rtmsg",
        ),
        (
            "permanent neighbour",
            lambda: _ours(nl.neigh_msg(7, ipaddress.ip_address("169.254.1.1"), MAC1), RTM_NEWNEIGH),
            lambda b: b.neigh("add", dst="169.254.1.1", lladdr=MAC1, ifindex=7, state=nl.NUD_PERMANENT),
            "ndmsg",
        ),
        (
            "proxy neighbour",
            lambda: _ours(nl.neigh_msg(7, ipaddress.ip_address("fd00::9"), proxy=True), RTM_NEWNEIGH),
            lambda b: b.neigh("add", dst="fd00::9", ifindex=7, state=nl.NUD_PERMANENT, flags=nl.NTF_PROXY),
            "ndmsg",
        ),
        (
            "the cluster network's on-link route over VXLAN",
            lambda: _sent_by(lambda rec: kernel.set_route(rec, vx_route, 110, 9)),
            lambda b: b.route("add", dst="10.244.4.0/24", gateway="10.244.4.0", oif=9, proto=110, flags=4),
            "rtmsg",
        ),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_requests_match_pyroute2_s_request_layer_byte_for_byte(case: tuple[str, Any, Any, str]) -> None:
    """The fixed header and every attribute (nested ones whole) are the bytes pyroute2 puts on the wire for the same
    operation; only the order of the attributes may differ."""
    _, ours, theirs, cls = case
    mine, reference = ours(), _pyroute2(theirs)
    assert struct.unpack_from("=H", mine, 4) == struct.unpack_from("=H", reference, 4)  # the message type
    assert _canon(mine, HEADER_SIZE[cls]) == _canon(reference, HEADER_SIZE[cls])


def _decoded_by_pyroute2(data: bytes, cls: str) -> Any:
    from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    msg = {"ifinfmsg": ifinfmsg, "ifaddrmsg": ifaddrmsg}[cls](data)
    msg.decode()
    return msg


def test_ipv6_address_has_no_dad_in_both_flag_fields() -> None:
    """pyroute2 sends IFA_F_NODAD in IFA_FLAGS only; we also set the header's 8-bit field, as ip(8) does."""
    got = _decoded_by_pyroute2(_ours(nl.addr_msg(3, V6), RTM_NEWADDR), "ifaddrmsg")
    assert got["flags"] == nl.IFA_F_NODAD and got.get_attr("IFA_FLAGS") == nl.IFA_F_NODAD
    assert got.get_attr("IFA_ADDRESS") == "fd00::5" and got["prefixlen"] == 64 and got["family"] == socket.AF_INET6


def test_hairpin_is_sent_as_bridge_port_data_the_way_iproute2_does() -> None:
    """``ip link set X type bridge_slave hairpin on``: IFLA_INFO_SLAVE_KIND "bridge" (pyroute2's brport sends the kind
    "bridge_slave" as IFLA_INFO_KIND instead, which the kernel only tolerates)."""
    msg = nl.link_msg(5, [nl.linkinfo(slave_kind="bridge", slave_data=[("IFLA_BRPORT_MODE", 1)])])
    back = _decoded_by_pyroute2(_ours(msg, RTM_NEWLINK), "ifinfmsg")
    assert back["index"] == 5
    info = back.get_attr("IFLA_LINKINFO")
    assert info.get_attr("IFLA_INFO_SLAVE_KIND") == "bridge" and info.get_attr("IFLA_INFO_KIND") is None
    assert info.get_attr("IFLA_INFO_SLAVE_DATA").get_attr("IFLA_BRPORT_MODE") == 1


# ---------------------------------------------------------------- a lean import


def test_the_dataplane_imports_no_netlink_library_and_nothing_it_would_bring() -> None:
    code = """
import json, sys
import cni.dataplane
heavy = ("pyroute2", "asyncio", "logging", "multiprocessing", "platform", "subprocess", "nodeplug.commands")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == [], f"importing the dataplane pulled in {out}"


def test_a_kernel_that_does_not_answer_in_time_is_try_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every netlink step has a deadline (issue 11, CNI 5); running out of it is transient (code 11), not a fault."""
    from cni.dataplane import rtnl

    monkeypatch.setattr(rtnl, "TIMEOUT", 0.05)
    sock = rtnl.Rtnl()
    try:
        with pytest.raises(rtnl.NetlinkError) as e:
            # A control message (type below NLMSG_MIN_TYPE) without NLM_F_ACK: the kernel takes it, does nothing and
            # never answers, which is what a kernel that does not answer in time looks like to the caller.
            sock.get(LinkMsg(), rtnl.NLMSG_NOOP, LinkMsg)
    finally:
        sock.close()
    assert e.value.code == errno.ETIMEDOUT
    err = nl.nl_error("get link eth0", e.value)
    assert err.code == 11 and err.details == "get link eth0: no answer from the kernel within 0.05s"
