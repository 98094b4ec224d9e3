"""The redirect program and its manager on this kernel, in throw-away netns: the verifier accepts the program as
built from the kernel's own BTF; a sync puts it on the routed pods' veths and the given devices and nowhere else
(not on a bridged pod's veth, nor on a veth that is not a pod's); the map of pods follows; an agent started again
takes the earlier agent's program off every device it was on; the uninstall's removal takes every one off. The
kernel's own list of what each device runs (BPF_PROG_QUERY) is the judge."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import struct
from collections.abc import Callable

import pytest

from cni.cluster import teardown
from cni.dataplane.rtnl import Rtnl
from cni.policy import quarantine
from cni.redirect import bpf, btf, manager, program, timeouts

from support.host import needs_root, sh
from support.innetns import inside

pytestmark = [needs_root]


def kernel_has_redirect() -> str:
    try:
        program.Kernel.read()
    except btf.BtfError as e:
        return str(e)
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return "" if m and (int(m[1]), int(m[2])) >= (6, 6) else "tcx needs Linux 6.6"


needs_redirect = pytest.mark.skipif(bool(kernel_has_redirect()), reason=kernel_has_redirect() or "ok")
pytestmark.append(needs_redirect)


@pytest.fixture
def node(netns: Callable[[], str]) -> str:
    """A netns with a routed pod's veth, a bridged pod's veth, a veth of nobody's, and an underlay."""
    ns = netns()
    for args in (
        ("link", "add", "veth0123abcd", "type", "veth", "peer", "name", "pod0"),
        ("link", "set", "veth0123abcd", "alias", "nodeplug veth0123abcd kubenet"),
        ("link", "add", "vethfeedbeef", "type", "veth", "peer", "name", "pod1"),
        ("link", "set", "vethfeedbeef", "alias", "nodeplug vethfeedbeef kubenet"),
        ("link", "add", "br0", "type", "bridge"),
        ("link", "set", "vethfeedbeef", "master", "br0"),
        ("link", "add", "vethcafe0000", "type", "veth", "peer", "name", "other"),  # no alias: not a pod's
        ("link", "add", "eth0", "type", "veth", "peer", "name", "eth0p"),
    ):
        sh("ip", "-n", ns, *args)
    return ns


def ours(ns: str) -> dict[str, list[int]]:
    def look(_: Rtnl) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for index, name in socket.if_nameindex():
            for pid in bpf.attached(index):
                with bpf.prog_by_id(pid) as p:
                    if bpf.prog_info(p).name == program.NAME:
                        out.setdefault(name, []).append(pid)
        return out

    found: dict[str, list[int]] = inside(ns, look)
    return found


def mapped(r: manager.Redirect) -> dict[int, int]:
    """The map of devices the loaded program consults: ifindex -> kind."""
    assert r.pods is not None
    return {int.from_bytes(k, "little"): int.from_bytes(r.pods.lookup(k) or b"", "little") for k in r.pods.walk()}


def generation(r: manager.Redirect) -> int:
    """The generation the loaded program compares each flow's decision with."""
    assert r.gen is not None
    return int.from_bytes(r.gen.lookup(b"\0\0\0\0") or b"", "little")


def index_of(ns: str, name: str) -> int:
    got: int = inside(ns, lambda _: socket.if_nametoindex(name))
    return got


def test_the_verifier_accepts_the_program_built_from_this_kernels_btf() -> None:
    k = program.Kernel.read()
    maps = manager.create_maps()
    try:
        with bpf.load(program.build(k, timeouts.Timeouts.read(), program.Maps(*(m.fd for m in maps))),
                      program.NAME) as prog:  # fmt: skip
            assert bpf.prog_info(prog).name == program.NAME
    finally:
        for m in maps:
            m.close()


def test_a_sync_attaches_to_routed_pod_veths_and_the_given_devices_only_and_follows_them(node: str) -> None:
    r = manager.Redirect()
    try:
        eth0 = index_of(node, "eth0")
        done = inside(node, lambda nl: r.sync(nl, [eth0]))
        assert done.problems == [] and done.pods == 1
        got = ours(node)
        assert set(got) == {"veth0123abcd", "eth0"}
        assert all(ids == [r.prog_id] for ids in got.values())
        veth, eth0_kind = index_of(node, "veth0123abcd"), program.UPLINK
        assert mapped(r) == {veth: program.READY, eth0: eth0_kind}
        # a second routed pod comes, the first goes
        sh("ip", "-n", node, "link", "add", "veth00000001", "type", "veth", "peer", "name", "pod2")
        sh("ip", "-n", node, "link", "set", "veth00000001", "alias", "nodeplug veth00000001 kubenet")
        sh("ip", "-n", node, "link", "del", "veth0123abcd")
        inside(node, lambda nl: r.sync(nl, [eth0]))
        assert set(ours(node)) == {"veth00000001", "eth0"}
        assert mapped(r) == {index_of(node, "veth00000001"): program.READY, eth0: program.UPLINK}
        # the device no longer given (the VXLAN device gone from the mode, another underlay): taken off
        inside(node, lambda nl: r.sync(nl, []))
        assert set(ours(node)) == {"veth00000001"}
        assert mapped(r) == {index_of(node, "veth00000001"): program.READY}
    finally:
        inside(node, manager.detach_all)
        r.close()


def test_an_agent_started_again_takes_the_earlier_program_off_and_the_removal_takes_all(node: str) -> None:
    first, second = manager.Redirect(), manager.Redirect()
    eth0 = index_of(node, "eth0")
    try:
        inside(node, lambda nl: first.sync(nl, [eth0]))
        first.close()  # the agent exits (or is killed): its program stays on the devices
        assert set(ours(node)) == {"veth0123abcd", "eth0"}
        done = inside(node, lambda nl: second.sync(nl, [eth0]))
        assert sorted(done.replaced) == ["eth0", "veth0123abcd"]
        got = ours(node)
        assert set(got) == {"veth0123abcd", "eth0"} and all(ids == [second.prog_id] for ids in got.values())
        assert sorted(inside(node, manager.detach_all)) == ["eth0", "veth0123abcd"]
        assert ours(node) == {}
    finally:
        inside(node, manager.detach_all)
        second.close()


def test_the_program_is_loaded_again_when_the_netns_conntrack_timeouts_change(node: str) -> None:
    """It keeps active flows' entries alive with the timeouts it was built for: when the netns's change (kube-proxy
    sets them when it starts), the next sync loads it again for them and puts it where the earlier one was."""
    r = manager.Redirect()
    key = "/proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream"
    eth0 = index_of(node, "eth0")
    try:
        assert inside(node, lambda nl: r.sync(nl, [eth0])).reloaded == ""
        first = r.prog_id
        again = inside(node, lambda nl: r.sync(nl, [eth0]))
        assert again.reloaded == "" and again.replaced == [] and r.prog_id == first  # nothing changed: nothing done
        sh("ip", "netns", "exec", node, "sh", "-c", f"echo 77 > {key}")
        done = inside(node, lambda nl: r.sync(nl, [eth0]))
        assert done.problems == [] and "udp stream 77 s" in done.reloaded and r.prog_id != first
        assert sorted(done.replaced) == ["eth0", "veth0123abcd"]
        got = ours(node)
        assert set(got) == {"veth0123abcd", "eth0"} and all(ids == [r.prog_id] for ids in got.values())
    finally:
        inside(node, manager.detach_all)
        r.close()


def test_the_counters_start_at_zero_for_a_new_load() -> None:
    r = manager.Redirect()
    try:
        r.load()
        assert r.counters() == {"peer": 0, "out": 0}
    finally:
        r.close()


def test_a_pod_whose_address_the_quarantine_holds_is_marked_held_until_let_go(node: str) -> None:
    """The quarantine's drop rules must see every packet of a held address: the map marks its veth held, and, while
    anything is held, a pod veth not yet routed (an ADD between making it and routing it) too."""
    sh("ip", "-n", node, "link", "set", "veth0123abcd", "up")
    sh("ip", "-n", node, "route", "add", "10.244.1.5/32", "dev", "veth0123abcd")
    sh("ip", "-n", node, "link", "add", "veth00000002", "type", "veth", "peer", "name", "pod3")
    sh("ip", "-n", node, "link", "set", "veth00000002", "alias", "nodeplug veth00000002 kubenet")
    r = manager.Redirect()
    held, unrouted = index_of(node, "veth0123abcd"), index_of(node, "veth00000002")
    try:
        inside(node, lambda _: quarantine.setup())
        assert inside(node, lambda nl: r.sync(nl, [])).held == 0  # nothing held: both ready
        assert mapped(r) == {held: program.READY, unrouted: program.READY}
        first = generation(r)
        inside(node, lambda nl: r.sync(nl, []))
        assert generation(r) == first  # the map as it was: the flows' decisions stand
        assert inside(node, lambda _: quarantine.hold(["10.244.1.5"])) is True
        assert inside(node, lambda nl: r.sync(nl, [])).held == 2
        assert mapped(r) == {held: program.HELD, unrouted: program.HELD}
        assert generation(r) > first  # every decision taken before is taken again, these veths' flows' too
        second = generation(r)
        sh("ip", "netns", "exec", node, "nft", "flush", "set", "inet", quarantine.TABLE, "q4")  # let go
        assert inside(node, lambda nl: r.sync(nl, [])).held == 0
        assert mapped(r) == {held: program.READY, unrouted: program.READY}
        assert generation(r) > second
    finally:
        inside(node, manager.detach_all)
        r.close()


def test_the_uninstalls_removal_takes_the_program_off(node: str) -> None:
    r = manager.Redirect()
    try:
        inside(node, lambda nl: r.sync(nl, [index_of(node, "eth0")]))
        done = inside(node, lambda nl: teardown.remove(nl, 110, None))
        assert any("redirect program off 2 device(s)" in line for line in done.removed)
        assert ours(node) == {}
    finally:
        inside(node, manager.detach_all)
        r.close()


TUNSETIFF, IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x400454CA, 0x0002, 0x1000, 0x4000


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)  # blocking: the tap builds the packet from the header length below
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    return fd


def _ipv4_tcp(src: str, dst: str, sport: int, dport: int, payload: bytes, ttl: int = 64) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, 0x10, 65535, 0, 0) + payload  # ACK
    head = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, ttl, 6, 0, socket.inet_aton(src),
                       socket.inet_aton(dst))  # fmt: skip
    total = sum(struct.unpack("!10H", head))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return head[:10] + struct.pack("!H", ~total & 0xFFFF) + head[12:] + tcp


@pytest.mark.skipif(not os.path.exists("/dev/net/tun"), reason="no /dev/net/tun")
@pytest.mark.skipif(not shutil.which("conntrack"), reason="conntrack (Debian package conntrack) not installed")
def test_a_packet_whose_headers_a_device_left_outside_the_linear_part_is_still_handed_over(
    netns: Callable[[], str],
) -> None:
    """A way in (here a tap, told by the virtio header that only the Ethernet header is linear, as a device that
    leaves the rest in page fragments) brings an established flow's packet for a routed pod: it goes straight into
    the pod (the program pulls the headers in first) rather than the ordinary way."""
    ns, pod = netns(), netns()
    fd = inside(ns, lambda _: _open_tap("tap0"))
    r = manager.Redirect()
    listener: socket.socket | None = None
    try:
        for args in (("link", "set", "tap0", "mtu", "9000", "up"),
                     ("addr", "add", "192.0.2.1/24", "dev", "tap0"),
                     ("link", "add", "veth0123abcd", "mtu", "9000", "type", "veth", "peer", "name", "eth0",
                      "mtu", "9000", "netns", pod),
                     ("link", "set", "veth0123abcd", "alias", "nodeplug veth0123abcd kubenet"),
                     ("link", "set", "veth0123abcd", "up"),
                     ("route", "add", "10.9.0.2/32", "dev", "veth0123abcd")):  # fmt: skip
            sh("ip", "-n", ns, *args)
        sh("ip", "-n", pod, "link", "set", "eth0", "up")
        sh("ip", "-n", pod, "addr", "add", "10.9.0.2/32", "dev", "eth0")
        pod_mac = json.loads(sh("ip", "-n", pod, "-j", "link", "show", "eth0"))[0]["address"]
        tap_mac = json.loads(sh("ip", "-n", ns, "-j", "link", "show", "tap0"))[0]["address"]
        sh("ip", "-n", ns, "neigh", "add", "10.9.0.2", "lladdr", pod_mac, "dev", "veth0123abcd", "nud", "permanent")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        flow = ["-p", "tcp", "-s", "192.0.2.7", "-d", "10.9.0.2", "--sport", "40000", "--dport", "80"]
        sh("ip", "netns", "exec", ns, "conntrack", "-I", *flow, "--state", "ESTABLISHED", "-u", "ASSURED,SEEN_REPLY",
           "-t", "120")  # fmt: skip
        inside(ns, lambda nl: r.sync(nl, [socket.if_nametoindex("tap0")]))
        listener = inside(pod, lambda _: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800)))
        listener.settimeout(5)
        frame = bytes.fromhex(tap_mac.replace(":", "")) + bytes.fromhex("02aabbccddee") + b"\x08\x00"
        frame += _ipv4_tcp("192.0.2.7", "10.9.0.2", 40000, 80, os.urandom(5000))  # past a page: not built linear
        vnet = struct.pack("<BBHHHH", 0, 0, 14, 0, 0, 0)  # no offloads; header length: the Ethernet header only
        os.write(fd, vnet + frame)
        got = listener.recv(65536)
        assert got[14 + 12 : 14 + 20] == frame[14 + 12 : 14 + 20] and got[14 + 8] == 63  # the pod has it, forwarded
        assert got[34:] == frame[34:]
        assert r.counters()["peer"] == 1  # by the program, not the ordinary path
    finally:
        if listener is not None:
            listener.close()
        os.close(fd)
        inside(ns, manager.detach_all)
        r.close()
