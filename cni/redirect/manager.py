"""Where the agent attaches the redirect program (:mod:`cni.redirect.program`), and when.

:class:`Redirect` loads the program once per agent (with its maps: the routed pods' host-side veths, the counters,
the flows' decisions and their generation), and again only when the netns's conntrack timeouts it was built with
change, and :meth:`Redirect.sync` brings the node's netns in line, as the cluster network's passes run (every
``resync_seconds`` at the latest) and whenever a pod's veth comes or goes (:mod:`cni.cluster.drift`):

- the program on the ingress of every routed pod's host-side veth (``veth`` + hex digits, nodeplug's alias, no
  bridge above it: bridged pods keep the bridge's path) and of the devices other nodes' packets arrive by (the
  underlay and the VXLAN device: the ways in);
- the map of devices the program consults: each such veth :data:`~cni.redirect.program.READY`, or
  :data:`~cni.redirect.program.HELD` while the quarantine holds one of its pod's addresses (its host routes), and
  each way in :data:`~cni.redirect.program.UPLINK`; when it changes, the generation moves on, so that no flow's
  decision taken with the map as it was is used again (:mod:`cni.redirect.program`). A held pod is looked at again
  after 1 s, then less and less often (:mod:`cni.cluster.network`): the policy agent lets its addresses go once it
  has the pod's rules in place;
- an earlier program (another load: an agent restarted, killed or upgraded, or this one's before the timeouts
  changed) taken off wherever it is, after this one is on, so that no packet finds neither; entries of veths that
  are gone leave the map;
- ``net.netfilter.nf_conntrack_tcp_be_liberal`` = 1 (:mod:`cni.redirect.program` says why).

Attachments belong to the devices (tcx), not to the agent: when it dies they keep working with the map as it was,
a veth made meanwhile takes the ordinary path until the next agent's first sync, and a veth deleted meanwhile took
its attachment with it. :func:`detach_all` takes every nodeplug program off every device (the uninstall; the
agent with ``redirect`` turned off).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

from cni.dataplane import sysctl
from cni.dataplane.messages import LinkMsg
from cni.dataplane.names import ALIAS_PREFIX, is_host_veth_name
from cni.dataplane.nl import AF_INET, AF_INET6, Rtnl, link_kind, links, routes
from cni.policy import quarantine
from cni.redirect import bpf, program, timeouts
from cni.redirect.btf import BtfError

BE_LIBERAL = "net/netfilter/nf_conntrack_tcp_be_liberal"
MAX_PODS = 65536
_U32 = struct.Struct("<I")


class RedirectError(Exception):
    pass


@dataclass
class Synced:
    """What one sync did (for logs and the doctor)."""

    pods: int = 0
    attached: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # an earlier load taken off (another agent's, or this one's)
    held: int = 0  # pods left on the ordinary path while the quarantine holds an address of theirs
    reloaded: str = ""  # the program loaded again for these conntrack timeouts
    problems: list[str] = field(default_factory=list)


def pod_veths(nl: Rtnl, dump: Sequence[LinkMsg] | None = None) -> dict[int, str]:
    """The routed pods' host-side veths of this netns (``dump``: its links, when the caller has them): ifindex ->
    name."""
    out: dict[int, str] = {}
    for msg in links(nl) if dump is None else dump:
        name = str(msg.get("IFLA_IFNAME") or "")
        alias = str(msg.get("IFLA_IFALIAS") or "")
        routed = not msg.get("IFLA_MASTER") and link_kind(msg) == "veth"
        if routed and is_host_veth_name(name) and alias.startswith(ALIAS_PREFIX):
            out[int(msg["index"])] = name
    return out


def create_maps() -> tuple[bpf.Map, bpf.Map, bpf.Map, bpf.Map]:
    """The program's maps, new and empty (:class:`cni.redirect.program.Maps` says what each holds): the devices,
    the counters, the flows and the generation; BpfError when the kernel refuses one (those made are closed)."""
    made: list[bpf.Map] = []
    try:
        for kind, key, value, entries, name in (
            (bpf.MAP_TYPE_HASH, 4, 4, MAX_PODS, "nodeplug_pods"),
            (bpf.MAP_TYPE_PERCPU_ARRAY, 4, 8, 2, "nodeplug_stats"),
            (bpf.MAP_TYPE_PERCPU_ARRAY, 4, program.SLOT_SIZE, program.SLOTS, "nodeplug_flows"),
            (bpf.MAP_TYPE_ARRAY, 4, 8, 1, "nodeplug_gen"),
        ):
            made.append(bpf.Map.create(kind, key, value, entries, name))
    except bpf.BpfError:
        for m in made:
            m.close()
        raise
    pods, stats, flows, gen = made
    return pods, stats, flows, gen


def _built(kernel: program.Kernel, t: timeouts.Timeouts, maps: program.Maps) -> bpf.Fd:
    """The program for this kernel and these timeouts, loaded, using ``maps``."""
    return bpf.load(program.build(kernel, t, maps), program.NAME)


def _ours(prog_id: int) -> bool:
    try:
        with bpf.prog_by_id(prog_id) as p:
            return bpf.prog_info(p).name == program.NAME
    except bpf.BpfError:
        return False  # gone meanwhile


def ours_on(ifindex: int) -> list[int]:
    """The ids of the nodeplug redirect programs on the device's ingress (any agent's load); BpfError when the
    kernel cannot list them."""
    return [pid for pid in bpf.attached(ifindex) if _ours(pid)]


def _take_off(ifindex: int, prog_id: int) -> None:
    try:
        with bpf.prog_by_id(prog_id) as p:
            bpf.detach(ifindex, p)
    except bpf.BpfError as e:
        if e.errno not in (2, 19):  # ENOENT: already off; ENODEV: the device is gone
            raise


def detach_all(nl: Rtnl) -> list[str]:
    """Take every nodeplug redirect program off every device of this netns; the devices it was on."""
    done: list[str] = []
    for msg in links(nl):
        index = int(msg["index"])
        try:
            ids = ours_on(index)
        except bpf.BpfError:
            continue
        for pid in ids:
            _take_off(index, pid)
            done.append(str(msg.get("IFLA_IFNAME") or index))
    return done


class Redirect:
    def __init__(self) -> None:
        self.prog: bpf.Fd | None = None
        self.pods: bpf.Map | None = None
        self.stats: bpf.Map | None = None
        self.flows: bpf.Map | None = None
        self.gen: bpf.Map | None = None
        self.generation = 0  # the generation last written: moved on whenever the map of devices changes
        self.prog_id = 0
        self.kernel: program.Kernel | None = None
        self.timeouts = timeouts.Timeouts()  # what the loaded program gives an active flow's entry
        self.known: dict[int, int] = {}  # the map as last written: ifindex -> program.READY, HELD or UPLINK
        self.unavailable = ""  # why this kernel cannot run it, once found
        self._cpus = 1

    def load(self) -> None:
        """Load the program and its maps (once); RedirectError naming what this kernel lacks."""
        if self.prog is not None:
            return
        if self.unavailable:  # this kernel will not grow it while the agent runs
            raise RedirectError(self.unavailable)
        try:
            kernel, conntrack = program.Kernel.read(), timeouts.Timeouts.read()
            maps = create_maps()
        except (BtfError, bpf.BpfError) as e:
            self.unavailable = f"redirect unavailable: {e}"
            raise RedirectError(self.unavailable) from None
        try:
            prog = _built(kernel, conntrack, program.Maps(*(m.fd for m in maps)))
        except bpf.BpfError as e:
            for m in maps:
                m.close()
            self.unavailable = f"redirect unavailable: the kernel refused the program: {e}"
            raise RedirectError(self.unavailable) from None
        self.kernel, self.timeouts = kernel, conntrack
        self.prog, (self.pods, self.stats, self.flows, self.gen) = prog, maps
        self.generation = 0
        self.prog_id = bpf.prog_info(prog).id
        self._cpus = bpf.possible_cpus()  # slots of a per-CPU value

    def _follow_timeouts(self, out: Synced) -> None:
        """Load the program again, with the same maps, when the netns's conntrack timeouts are no longer the ones it
        was built with (kube-proxy sets them when it starts, perhaps after this agent; an operator may tune them):
        an entry refreshed with a stale, longer timeout would outlive its flow by that much. The sync then puts the
        new program where the old one is."""
        assert self.kernel is not None
        now = timeouts.Timeouts.read()
        if now == self.timeouts:
            return
        try:
            prog = _built(self.kernel, now, self._fds())
        except bpf.BpfError as e:
            out.problems.append(f"conntrack timeouts changed, the program built for them was refused: {e}")
            return
        old, self.prog, self.timeouts = self.prog, prog, now
        self.prog_id = bpf.prog_info(prog).id
        out.reloaded = f"tcp established {now.tcp_seconds} s, udp stream {now.udp_seconds} s"
        if old is not None:
            old.close()  # where it is attached, the attachment holds it until the sync takes it off

    def _fds(self) -> program.Maps:
        assert self.pods is not None and self.stats is not None and self.flows is not None and self.gen is not None
        return program.Maps(self.pods.fd, self.stats.fd, self.flows.fd, self.gen.fd)

    def sync(self, nl: Rtnl, devices: Iterable[int]) -> Synced:
        """Bring this netns in line: the program on each pod veth and on ``devices`` (ifindexes), the map of pods
        current, every other load of it off."""
        out = Synced()
        if self.prog is None:
            self.load()  # built for the timeouts it has just read
        else:
            self._follow_timeouts(out)
        assert self.prog is not None and self.pods is not None
        sysctl.ensure(BE_LIBERAL, "1", missing_ok=True)  # absent until conntrack is loaded: set at a later sync
        dump = links(nl)
        veths = pod_veths(nl, dump)
        devices = set(devices)
        held = self._held(nl, veths, out)
        kinds = {i: program.HELD if i in held else program.READY for i in veths}
        kinds |= {i: program.UPLINK for i in devices}
        for index, kind in kinds.items():
            if self.known.get(index) != kind:
                self.pods.update(_U32.pack(index), _U32.pack(kind))
        for index in self.known.keys() - kinds.keys():
            self.pods.delete(_U32.pack(index))
        if kinds != self.known:  # every flow's decision taken before is taken again, with the map as it is now
            assert self.gen is not None
            self.generation += 1
            self.gen.update(_U32.pack(0), struct.pack("<Q", self.generation))
        self.known = kinds
        out.held = len(held)
        want = set(veths) | devices
        for msg in dump:
            index = int(msg["index"])
            name = str(msg.get("IFLA_IFNAME") or index)
            try:
                ids = bpf.attached(index)
            except bpf.BpfError as e:
                if index in want:
                    out.problems.append(f"{name}: cannot list its programs: {e.strerror}")
                continue
            if index in want and self.prog_id not in ids:
                try:
                    bpf.attach(index, self.prog)
                except bpf.BpfError as e:
                    if e.errno == 22:  # EINVAL: no tcx
                        out.problems.append(f"{name}: cannot attach: {e.strerror} (tcx needs Linux 6.6 or later)")
                    elif e.errno != 19:  # ENODEV: a pod's veth deleted meanwhile
                        out.problems.append(f"{name}: cannot attach: {e.strerror}")
                    continue
                out.attached.append(name)
            for pid in ids:
                if pid != self.prog_id and _ours(pid):
                    _take_off(index, pid)
                    out.replaced.append(name)
            if index not in want and self.prog_id in ids:
                _take_off(index, self.prog_id)
        out.pods = len(veths)
        return out

    @staticmethod
    def _held(nl: Rtnl, veths: dict[int, str], out: Synced) -> set[int]:
        """The pod veths with an address the quarantine holds (each pod's addresses: its host routes), and, while it
        holds any, those without a host route yet (an ADD between making the veth and routing its addresses: they
        may be held ones); every one when the quarantine cannot be read (closed, as the quarantine itself)."""
        try:
            held = quarantine.held()
        except quarantine.QuarantineError as e:
            out.problems.append(f"pods kept on the ordinary path: {e}")
            return set(veths)
        if not held:
            return set()
        found: set[int] = set()
        routed: set[int] = set()
        for family in (AF_INET, AF_INET6):
            for msg in routes(nl, family):
                oif = msg.get("RTA_OIF")
                if oif in veths:
                    routed.add(int(oif))
                    if str(msg.get("RTA_DST")) in held:
                        found.add(int(oif))
        return found | (set(veths) - routed)

    def counters(self) -> dict[str, int]:
        """Packets handed over since this load: ``peer`` (into a pod of this node), ``out`` (from a pod)."""
        if self.stats is None:
            return {"peer": 0, "out": 0}
        got: dict[str, int] = {}
        for key, name in ((program.PEER, "peer"), (program.OUT, "out")):
            raw = self.stats.lookup(_U32.pack(key), 8 * self._cpus) or b""
            got[name] = sum(v for (v,) in struct.iter_unpack("<Q", raw))
        return got

    def close(self) -> None:
        """Let go of this agent's descriptors (the attachments stay with the devices)."""
        for fd in (self.prog, self.pods, self.stats, self.flows, self.gen):
            if fd is not None:
                fd.close()
        self.prog = self.pods = self.stats = self.flows = self.gen = None
        self.known = {}


class Counters:
    """The collector of ``nodeplug_cluster_redirected_packets_total{way}`` (``peer``: into a pod of this node;
    ``out``: from a pod, out of another device), read from the program's counters at each scrape."""

    def __init__(self) -> None:
        self.source: Redirect | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "nodeplug_cluster_redirected_packets",
            "Packets of established pod flows the redirect handed over past the node's forwarding path, by way.",
            labels=["way"],
        )
        source = self.source
        if source is not None:
            try:
                got = source.counters()
            except OSError:
                got = {}
            for way, n in got.items():
                fam.add_metric([way], n)
        yield fam
