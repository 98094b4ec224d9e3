"""The redirect program and its manager on this kernel, in throw-away netns: the verifier accepts the program as
built from the kernel's own BTF; a sync puts it on the routed pods' veths and the given devices and nowhere else
(not on a bridged pod's veth, nor on a veth that is not a pod's); the map of pods follows; an agent started again
takes the earlier agent's program off every device it was on; the uninstall's removal takes every one off. The
kernel's own list of what each device runs (BPF_PROG_QUERY) is the judge."""

from __future__ import annotations

import os
import re
import socket
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


def index_of(ns: str, name: str) -> int:
    got: int = inside(ns, lambda _: socket.if_nametoindex(name))
    return got


def test_the_verifier_accepts_the_program_built_from_this_kernels_btf() -> None:
    k = program.Kernel.read()
    with (
        bpf.Map.create(bpf.MAP_TYPE_HASH, 4, 4, 16, "t_pods") as pods,
        bpf.Map.create(bpf.MAP_TYPE_PERCPU_ARRAY, 4, 8, 2, "t_stats") as stats,
        bpf.load(program.build(k, timeouts.Timeouts.read(), pods.fd, stats.fd), program.NAME) as prog,
    ):
        assert bpf.prog_info(prog).name == program.NAME


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
        assert inside(node, lambda _: quarantine.hold(["10.244.1.5"])) is True
        assert inside(node, lambda nl: r.sync(nl, [])).held == 2
        assert mapped(r) == {held: program.HELD, unrouted: program.HELD}
        sh("ip", "netns", "exec", node, "nft", "flush", "set", "inet", quarantine.TABLE, "q4")  # let go
        assert inside(node, lambda nl: r.sync(nl, [])).held == 0
        assert mapped(r) == {held: program.READY, unrouted: program.READY}
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
