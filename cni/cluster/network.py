"""The agent's cluster network service: follows Node objects and keeps this node's kernel in step.

One watch on Nodes (:class:`nodeplug.kube.ListWatch`) feeds a map of parsed nodes; every change marks the state
dirty and one reconciler task brings the kernel in line on a thread of its own (netlink is synchronous): the plan
(:mod:`cni.cluster.plan`) is computed for all nodes and compared with what the agent last applied, so a Node added
costs a few netlink requests however many Nodes there are. Events that arrive while a pass runs are folded into
the next one. A full pass, which reads the kernel back and repairs any drift (an entry deleted or changed by
someone else, a stale entry from an earlier run), runs after every complete list from the API server, every
``resync_seconds``, as soon as the kernel announces a change that may have undone some of it (a route of ours
deleted, a device down or gone, an FDB entry removed: :mod:`cni.cluster.drift`; at most one such pass every
:data:`DRIFT_SPACING` seconds), and soon after a pass the kernel refused part of (2 s, doubled each time up to the
resync): whatever made the kernel refuse, an interface's IPv6 switched off for instance, may have flushed entries
that had landed too.

Until the first complete list the kernel is not touched: routes, FDB and neighbour entries from an earlier run
keep carrying traffic while the agent restarts or the API server is away, and the subnets file from the last run
keeps the IPAM on this node's podCIDRs. This node's own Node object gives:

- its podCIDRs, written to the subnets file (:mod:`cni.nodesubnets`) with the pod MTU (the underlay's, less
  the VXLAN overhead in ``vxlan`` and ``auto`` modes);
- its first InternalIP, the VXLAN device's local address, published with the device's MAC as annotations on the
  Node (a merge patch of exactly those two keys) so that peers can program their FDB and neighbours.

With ``redirect`` on, each full pass (and a change of the underlay or VXLAN device) also brings the redirect in line
(:mod:`cni.redirect.manager`), and so does a pod's veth coming or going, as the kernel announces it, on the netlink
thread between passes; with it off, the first full pass takes an earlier agent's program off.

The kernel is changed only while this agent holds the cluster network's lock and no uninstall is requested
(:mod:`cni.cluster.uninstall`). A guard task looks at the uninstall marker every
:data:`~cni.cluster.uninstall.POLL_SECONDS`: when it appears, no further pass starts, the one under way finishes
(passes and the removal share the netlink thread), the agent removes what it owns (:mod:`cni.cluster.teardown`),
releases the lock and stays out, not ready, naming the cure; when the marker goes (a new ``install-cni``), it takes
the lock again and makes a full pass. On stop (SIGTERM, a restart, an upgrade) nothing is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
from collections.abc import Set
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Node

from cni.cluster import apiserver, drift, kernel, masq, offload, teardown, uninstall
from cni.cluster.config import ClusterConfig
from cni.cluster.findings import Findings, Metrics, Outcome
from cni.cluster.model import (
    IPAddress,
    IPNetwork,
    NodeInfo,
    Vtep,
    parse_node,
    slim_node,
)
from cni.cluster.ownnode import OwnNode
from cni.cluster.plan import Local, State, changes, desired
from cni.dataplane import sysctl
from cni.dataplane.rtnl import Rtnl
from cni.errors import CniError
from cni.nodesubnets import NodeSubnets, SubnetsError, read
from cni.redirect import manager as redirect
from nodeplug.fsutil import write_atomic
from nodeplug.kube import KubeClient, ListWatch
from nodeplug.kube.events import EventRecorder, Regarding
from nodeplug.kube.health import ApiHealth
from nodeplug.log import Logger

CURE = (
    "run kube-controller-manager with --allocate-node-cidrs --cluster-cidr=<cluster CIDR>, or set it by hand: "
    'kubectl patch node {node} -p \'{{"spec":{{"podCIDRs":["10.244.1.0/24"]}}}}\''
)


DRIFT_SPACING = 0.5  # seconds between two full passes asked for by kernel events (a flapping device)
RETRY_SECONDS = 2.0  # the first retry of a pass the kernel refused part of; doubled each time, up to the resync


class ClusterNetwork:
    def __init__(
        self,
        cfg: ClusterConfig,
        kube: KubeClient,
        node: str,
        subnets_path: Path,
        log: Logger,
        metrics: Metrics | None = None,
        lock_path: Path = Path(uninstall.LOCK),
        marker_path: Path = Path(uninstall.MARKER),
        events: EventRecorder | None = None,
        health: ApiHealth | None = None,
    ) -> None:
        self.cfg = cfg
        self.kube = kube
        self.node = node
        self.subnets_path = subnets_path
        self.log = log.bind(node=node)
        self.nodes: dict[str, NodeInfo] = {}
        self.synced = False
        self.watch = ListWatch(kube, Node, log=self.log, transform=slim_node, keep_objects=False)
        self.own = OwnNode(kube, node, self.log, self.watch.backoff, self._dirty_full)
        self.outcome = Outcome()
        self.have = State.empty()
        self._dirty = asyncio.Event()
        self._full = True
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._nl: Rtnl | None = None
        self._subnets: NodeSubnets | None = None
        self._masq: tuple[Any, ...] | None = None
        self.metrics = metrics or Metrics()
        self.findings = Findings(node, self.metrics, self.log, events)
        self.health = health
        self.api_addresses: tuple[IPAddress, ...] = ()  # where the API server is, as this agent reaches it
        self.withdrawn: dict[IPNetwork, str] = {}  # our routes taken away because the API server's path ran there
        self._follower: asyncio.Task[None] | None = None
        self._drift: drift.DriftWatch | None = None
        self._drift_at = -DRIFT_SPACING  # when kernel events last asked for a full pass
        self._drift_timer: asyncio.TimerHandle | None = None
        self.lock = uninstall.Lock(lock_path)
        self.marker = marker_path
        self._cluster = tuple(ipaddress.ip_network(c) for c in cfg.cluster_cidrs)
        self.redirect = redirect.Redirect() if cfg.redirect else None
        self.metrics.redirected.source = self.redirect
        self._redirect_devices: tuple[int, ...] = ()  # the underlay and VXLAN device of the last pass
        self._redirect_pending = False  # a sync for pod veths queued on the netlink thread
        self._redirect_cleared = False  # redirect off: programs of an earlier agent taken off (once)
        self._redirect_problems: list[str] = []  # what the last redirect sync found wrong
        self._held_wait = 0.0  # pods held by the quarantine: the wait before the redirect looks again
        self._loop: asyncio.AbstractEventLoop | None = None
        self.role = "starting"  # managing (holding the lock) | removed (an uninstall asked) | waiting (lock taken)

    def _dirty_full(self) -> None:
        """Ask for a full pass (a write to this Node the API server refused is tried again after it)."""
        self._full = True
        self._dirty.set()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            self._subnets = await asyncio.to_thread(read, str(self.subnets_path))
        except SubnetsError as e:
            self.log.warning("ignoring the subnets file of an earlier run", error=str(e))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cluster-net")
        self._loop = asyncio.get_running_loop()
        self._drift = drift.DriftWatch(self.cfg.route_protocol)
        asyncio.get_running_loop().add_reader(self._drift.fileno(), self._kernel_changed)
        self._follower = asyncio.create_task(self._follow(), name="cluster-watch")
        self._tasks = [
            asyncio.create_task(self._reconcile_loop(), name="cluster-reconcile"),
            asyncio.create_task(self._guard(), name="cluster-guard"),
            asyncio.create_task(self._find_api_server(), name="cluster-api-addresses"),
        ]
        if self.health is not None:
            self._tasks.append(asyncio.create_task(self._heal(), name="cluster-heal"))
        self.log.info("following Node objects", mode=self.cfg.mode, server=self.kube.source.server)

    async def stop(self) -> None:
        tasks = [*self._tasks, *([self._follower] if self._follower is not None else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks, self._follower = [], None
        if self._drift is not None:
            asyncio.get_running_loop().remove_reader(self._drift.fileno())
            self._drift.close()
            self._drift = None
        if self._drift_timer is not None:
            self._drift_timer.cancel()
            self._drift_timer = None
        if self._pool is not None:
            loop = asyncio.get_running_loop()
            if self._nl is not None:
                nl, self._nl = self._nl, None
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(self._pool, nl.close)
            # after whatever pass or removal is still on the netlink thread; the kernel state stays as it is
            with contextlib.suppress(Exception):
                await asyncio.wait_for(loop.run_in_executor(self._pool, self.lock.release), 30)
            self._pool.shutdown(wait=False)
            self._pool = None
        self.lock.release()
        if self.redirect is not None:
            self.redirect.close()  # the attachments stay with the devices, working with the map as it is

    # ------------------------------------------------------------ following the kernel

    def _kernel_changed(self) -> None:
        """Kernel events arrived (:mod:`cni.cluster.drift`): a full pass now, or once :data:`DRIFT_SPACING` has
        passed since the last one they asked for."""
        assert self._drift is not None
        try:
            why = self._drift.read()
        except OSError as e:
            why = f"kernel events unreadable: {e}"
        if self._drift.pod_links and self.redirect is not None and self.role == "managing":
            self._drift.pod_links = False
            self._queue_redirect_sync()
        if not why or self._drift_timer is not None:
            return
        self.log.debug("cluster network: the kernel changed; a full pass follows", reason=why)
        loop = asyncio.get_running_loop()
        self._drift_timer = loop.call_at(max(loop.time(), self._drift_at + DRIFT_SPACING), self._drift_pass)

    def _queue_redirect_sync(self) -> None:
        """A pod's veth came or went: the redirect's attachments follow on the netlink thread (one queued at a
        time; events meanwhile fold into it)."""
        if self._redirect_pending or self._pool is None:
            return
        self._redirect_pending = True
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._redirect_sync_now)
        fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())

    def _redirect_sync_now(self) -> None:
        self._redirect_pending = False
        if self.role != "managing":
            return
        before = self._redirect_problems
        for line in self._redirect_sync(self._redirect_devices):
            if line not in before:  # the next pass makes it a finding (an Event) too
                self.log.warning("cluster network: redirect", problem=line)

    def _redirect_sync(self, devices: tuple[int, ...]) -> list[str]:
        """On the netlink thread: the redirect in line with this netns (:mod:`cni.redirect.manager`), or, with it
        turned off, an earlier agent's programs taken off once; the problems found."""
        if self._nl is None:
            self._nl = Rtnl()
        if self.redirect is None:
            if not self._redirect_cleared:
                try:
                    gone = redirect.detach_all(self._nl)
                except OSError as e:
                    self._redirect_problems = [f"cannot take an earlier agent's redirect program off: {e}"]
                    return self._redirect_problems
                self._redirect_problems = []
                if gone:
                    self.log.info("cluster network: redirect is off; took its program off", devices=",".join(gone))
                self._redirect_cleared = True
            return []
        try:
            done = self.redirect.sync(self._nl, devices)
        except (redirect.RedirectError, OSError, CniError) as e:
            self._redirect_problems = [str(e)]
            return self._redirect_problems
        if done.held:  # the policy agent lets their addresses go as it learns of the pods: look again, less often
            self._held_wait = min(max(self._held_wait * 2, 1.0), self.cfg.resync_seconds)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.call_later, self._held_wait, self._queue_redirect_sync)
        else:
            self._held_wait = 0.0
        if done.reloaded:
            self.log.info("cluster network: redirect program loaded again for the conntrack timeouts now set",
                          timeouts=done.reloaded)  # fmt: skip
        if done.attached or done.replaced:
            self.log.info("cluster network: redirect attached", devices=",".join(done.attached),
                          replaced=",".join(done.replaced), pods=done.pods)  # fmt: skip
        self._redirect_problems = done.problems
        return done.problems

    def _drift_pass(self) -> None:
        self._drift_timer = None
        self._drift_at = asyncio.get_running_loop().time()
        self._dirty_full()

    # ------------------------------------------------------------ following the API

    async def _follow(self) -> None:
        async for ev in self.watch.events():
            if ev.type == "SYNCED":
                self.synced = True
                self._full = True
            elif ev.type == "DELETED":  # the key is the Node's name (its last state is not kept)
                self.nodes.pop(ev.key, None)
                if ev.key == self.node:
                    self.own.forget()
            else:
                assert ev.obj is not None
                info = parse_node(ev.obj)
                if info is None:
                    continue
                self.nodes[info.name] = info
                if info.name == self.node and self.own.update(ev.obj):
                    self._full = True  # its NetworkUnavailable set to something else: the next full pass clears it
            if self.synced:
                self._dirty.set()

    async def _reconcile_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_full = last_pass = 0.0
        retry_in = 0.0  # after a pass the kernel refused part of: the wait before a full pass tries again
        while True:
            timeout = None  # nothing to do before the first complete list, or while not managing
            if self.synced and self.role == "managing":
                timeout = max(self.cfg.resync_seconds - (time.monotonic() - last_full), 0.0)
                if retry_in:
                    timeout = min(timeout, max(retry_in - (time.monotonic() - last_pass), 0.0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=timeout)
            self._dirty.clear()
            if not self.synced or self.role != "managing":
                continue
            full = self._full or time.monotonic() - last_full >= self.cfg.resync_seconds
            self._full = False
            nodes = dict(self.nodes)
            started = time.monotonic()
            try:
                outcome = await loop.run_in_executor(self._pool, self._pass, nodes, full)
            except Exception as e:  # never let one bad pass end the loop: the next event or resync retries
                self.log.error("cluster network pass failed", error=str(e) or repr(e), exc_info=True)
                self._full = True
                await asyncio.sleep(1.0)
                continue
            self.metrics.pass_seconds.labels("full" if full else "incremental").observe(time.monotonic() - started)
            if full:
                last_full = time.monotonic()
            last_pass = time.monotonic()
            if outcome.refused:
                # what made the kernel refuse (a device's IPv6 switched off, an address gone) may also have taken
                # entries that had landed: the retry reads the kernel back, sooner at first, then every resync
                self._full = True
                retry_in = min(max(retry_in * 2, RETRY_SECONDS), self.cfg.resync_seconds)
            else:
                retry_in = 0.0
            self.outcome = outcome
            self.findings.report(outcome)
            await self.own.publish(outcome.vtep)
            if full and outcome.own_programmed and not await self.own.network_available():
                self._full = True

    # ------------------------------------------------------------ the node's lifeline: the API server

    async def _find_api_server(self) -> None:
        """Keep :attr:`api_addresses` current (:func:`cni.cluster.apiserver.addresses`), read at start and every
        ``resync_seconds``. A podCIDR holding one of them is never routed."""
        while True:
            known = await apiserver.addresses(self.kube, self.api_addresses)
            if known and set(known) != set(self.api_addresses):
                self.api_addresses = known
                self.log.info("the API server's addresses, never routed to a pod network",
                              addresses=",".join(map(str, known)))  # fmt: skip
                self._dirty_full()
            await asyncio.sleep(self.cfg.resync_seconds)

    async def _heal(self) -> None:
        """While the API server does not answer, take away any route of ours the path to it runs through (a podCIDR
        the plan could not know held it, a route someone planted with our protocol): the node keeps its way to the
        API server whatever the Nodes say. When it answers again after an outage, the watch starts over (its
        connection may have died with the path)."""
        assert self.health is not None
        loop = asyncio.get_running_loop()
        while True:
            reachable = await self.health.changed()
            if reachable:
                if self._follower is not None:
                    self._follower.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await self._follower
                self._follower = asyncio.create_task(self._follow(), name="cluster-watch")
                continue
            while self.health.reachable is False:
                if self.role == "managing" and self._pool is not None:
                    for dst, line in await loop.run_in_executor(self._pool, self._withdraw_api_paths):
                        self.withdrawn[dst] = line
                        self.metrics.withdrawn.inc()
                        self.log.warning("cluster network: route withdrawn", route=str(dst), reason=line)
                        self.findings.event(
                            Regarding.node(self.node), "RouteWithdrawn", f"route to {dst} withdrawn: {line}"
                        )
                await asyncio.sleep(self.health.interval)

    def _withdraw_api_paths(self) -> list[tuple[IPNetwork, str]]:
        """On the netlink thread: delete each route of ours that the path to an API server address takes."""
        if self._nl is None:
            self._nl = Rtnl()
        return apiserver.withdraw(self._nl, self.api_addresses, self.have.routes, self.cfg.route_protocol, self.log)

    # ------------------------------------------------------------ who changes the kernel (uninstall)

    async def _guard(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                # the marker, the lock and its record are files: looked at on the netlink thread, after any pass
                if await loop.run_in_executor(self._pool, uninstall.requested, self.marker):
                    if self.role != "removed":
                        await self._stand_down()
                elif self.role != "managing":
                    await self._take_over()
            except Exception as e:  # e.g. the runtime directory unwritable: said once, tried again at every look
                if self.role != "error":
                    self.log.error("cluster network: cannot take it up or down", error=str(e) or repr(e))
                self.role = "error"
            await asyncio.sleep(uninstall.POLL_SECONDS)

    async def _take_over(self) -> None:
        got = await asyncio.get_running_loop().run_in_executor(self._pool, self._claim)
        if got == "waiting":
            if self.role != "waiting":
                self.log.warning("cluster network: its lock is held by another process", lock=str(self.lock.path))
            self.role = "waiting"
            return
        if got == "asked":  # asked between our look and the lock: the next look stands down
            return
        if self.role == "removed":
            self.log.info("cluster network: the uninstall marker is gone (install-cni ran): managing it again")
        self.role = "managing"
        self._full = True
        self._dirty.set()

    def _claim(self) -> str:
        """On the netlink thread: take the lock and record what this agent manages; "managing", "waiting" (the
        lock is another process's) or "asked" (an uninstall was requested meanwhile)."""
        if not self.lock.try_acquire():
            return "waiting"
        if uninstall.requested(self.marker):
            self.lock.release()
            return "asked"
        record = uninstall.Record(self.node, uninstall.this_netns(), self.cfg.route_protocol,
                                  str(self.subnets_path), os.getpid())  # fmt: skip
        self.lock.write(record)
        return "managing"

    async def _stand_down(self) -> None:
        was = self.role
        self.role = "removing"  # no pass starts from here on; the one under way finishes first on the netlink thread
        done = await asyncio.get_running_loop().run_in_executor(self._pool, self._remove)
        if done is None:  # someone else (install-cni) is removing it right now: look again soon
            self.role = was if was != "managing" else "waiting"
            return
        self.role = "removed"
        for line in done.removed:
            self.log.info("cluster network: uninstall", done=line)
        for line in done.kept:
            self.log.info("cluster network: uninstall", kept=line)
        for line in done.failed:
            self.log.warning("cluster network: uninstall failed to remove", problem=line)
        self.log.info("cluster network: removed from this node; not managed until `nodeplug install-cni` runs again",
                      failed=len(done.failed))  # fmt: skip

    def _remove(self) -> teardown.Removal | None:
        """On the netlink thread, after any pass under way: take the lock (None when another process holds it),
        remove, forget what the passes knew, and let go of the lock only then (also when the removal fails: the
        guard's next look tries again)."""
        if not self.lock.try_acquire():
            return None
        try:
            self.log.warning("cluster network: uninstall requested; removing what this agent owns",
                             marker=str(self.marker))  # fmt: skip
            if self._nl is None:
                self._nl = Rtnl()
            done = teardown.remove(self._nl, self.cfg.route_protocol, self.subnets_path)
            if self.redirect is not None:
                self.redirect.close()  # taken off by the removal; a new load if the agent manages it again
                self.redirect = self.metrics.redirected.source = redirect.Redirect()
            self._redirect_devices = ()
            self.have = State.empty()
            self._subnets = None
            self._masq = None
            self.outcome = Outcome()
            return done
        finally:
            self.lock.release()

    # ------------------------------------------------------------ one pass (on the netlink thread)

    def _pass(self, nodes: dict[str, NodeInfo], full: bool) -> Outcome:
        if self._nl is None:
            self._nl = Rtnl()
        nl = self._nl
        out = Outcome()
        own = nodes.get(self.node)
        pod_cidrs = own.pod_cidrs if own is not None else ()
        local_ip = own.internal_ips[0] if own is not None and own.internal_ips else None
        vx_index: int | None = None
        underlay = None
        if local_ip is not None:
            try:
                underlay = kernel.underlay_of(nl, local_ip, self.cfg.vxlan.underlay)
            except kernel.KernelError as e:
                out.problems.append(str(e))
        if self.cfg.mode == "direct":
            if full:
                kernel.remove_vxlan(nl)
            out.mtu = underlay.mtu if underlay is not None else None
        elif underlay is not None and local_ip is not None:
            vxlan = self.cfg.vxlan
            vx = kernel.ensure_vxlan(nl, self.node, vxlan.vni, vxlan.port, local_ip, underlay,
                                     tx_checksum_offload=offload.wanted(vxlan.tx_checksum_offload))  # fmt: skip
            if vx.created:
                self.log.info("created the VXLAN device", device=kernel.VXLAN_DEVICE, mac=vx.mac, local=str(local_ip))
                full = True  # entries of an earlier device are gone with it
            vx_index, out.vtep, out.mtu = vx.ifindex, Vtep(vx.mac, local_ip), vx.mtu
        else:
            vx_index = kernel.vxlan_index(nl)
            out.problems.append(f"node {self.node} has no InternalIP on this host: no VXLAN endpoint")
        connected = kernel.connected(nl, pod_cidrs, [vx_index] if vx_index is not None else [])
        lifelines = (*self.api_addresses, *kernel.default_gateways(nl), *(own.internal_ips if own else ()))
        local = Local(self.node, pod_cidrs, tuple(connected), out.vtep, self._cluster, tuple(dict.fromkeys(lifelines)),
                      (self.cfg.broadest_pod_cidr.ipv4, self.cfg.broadest_pod_cidr.ipv6))  # fmt: skip
        want = desired(local, nodes.values(), self.cfg.mode)
        for dst in [d for d in self.withdrawn if d not in want.state.routes]:
            del self.withdrawn[dst]  # no Node asks for it any more
        owner: dict[IPNetwork, tuple[str, int]] = {}
        for peer, v in want.paths:
            cidr = nodes[peer].pod_cidr(v)
            if cidr is not None:
                owner[cidr] = (peer, v)
        for dst, why in self.withdrawn.items():
            want.state.routes.pop(dst, None)
            if dst in owner:
                want.paths.pop(owner[dst], None)
                want.unrouted[owner[dst]] = f"withdrawn: {why}"
        if full:
            owned = kernel.read_owned(nl, self.cfg.route_protocol, vx_index)
            self.have = owned.state
            for dst in owned.foreign & set(want.state.routes):
                out.problems.append(f"route to {dst}: a route nodeplug does not own exists for it; left alone")
                want.state.routes.pop(dst)
        ch = changes(want.state, self.have)
        if ch:
            applied = kernel.apply(nl, ch, self.have, self.cfg.route_protocol, vx_index)
            self.metrics.changed.labels("done").inc(applied.done)
            self.metrics.changed.labels("failed").inc(len(applied.failed))
            out.refused = bool(applied.failed)
            for target, why in applied.failed:
                if target is not None and target in owner:
                    out.failed[owner[target]] = why
                else:
                    out.problems.append(why)
        if want.state.routes:
            families = {r.dst.version for r in want.state.routes.values()}
            if 4 in families:
                sysctl.ensure("net/ipv4/ip_forward", "1")
            if 6 in families:
                sysctl.ensure("net/ipv6/conf/all/forwarding", "1")
        out.paths, out.unrouted, out.own_refused = want.paths, want.unrouted, want.own_refused
        out.own_programmed = bool(want.own) and not out.failed
        if own is not None:
            refused = tuple((str(c), why) for c, why in want.own_refused)
            self._write_subnets(NodeSubnets(self.node, tuple(str(c) for c in want.own), out.mtu, refused))
        self._masquerade(want.own, nodes, want.refused, out)
        devices = tuple(i for i in (underlay.ifindex if underlay is not None else None, vx_index) if i is not None)
        if full or devices != self._redirect_devices:
            self._redirect_devices = devices
            self._redirect_sync(devices)
        out.problems += self._redirect_problems  # findings last while they hold: every pass carries them
        return out

    def _write_subnets(self, want: NodeSubnets) -> None:
        if want == self._subnets:
            return
        self.subnets_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.subnets_path, want.dumps())
        self._subnets = want
        self.log.info("pod subnets of this node", pod_cidrs=",".join(want.pod_cidrs) or "none", mtu=want.mtu)

    def _masquerade(
        self, pod_cidrs: tuple[IPNetwork, ...], nodes: dict[str, NodeInfo], refused: Set[tuple[str, int]], out: Outcome
    ) -> None:
        if not self.cfg.masquerade:
            if self._masq != ():
                masq.remove()
                self._masq = ()
            return
        if self._cluster:
            cluster: list[IPNetwork] = list(self._cluster)
        else:
            cluster = [c for n in nodes.values() for c in n.pod_cidrs if (n.name, c.version) not in refused]
        merged: list[IPNetwork] = [
            *ipaddress.collapse_addresses(c for c in cluster if isinstance(c, ipaddress.IPv4Network)),
            *ipaddress.collapse_addresses(c for c in cluster if isinstance(c, ipaddress.IPv6Network)),
        ]
        key = (tuple(pod_cidrs), tuple(merged))
        if key == self._masq or not pod_cidrs:
            return
        try:
            masq.install(pod_cidrs, merged)
            self._masq = key
        except masq.MasqError as e:
            out.problems.append(str(e))

    def readiness(self) -> tuple[bool, str]:
        """(ready, detail) for /readyz. Not ready while this node has no pod subnet to hand out, while the API
        server does not answer (the network keeps its state meanwhile), and while a planned kernel change is refused
        (naming the peer)."""
        if self.health is None or self.health.reachable is None:
            api_ok, api = self.watch.status.connected, (
                "API server reachable" if self.watch.status.connected
                else f"API server not reached yet ({self.watch.status.last_error or 'connecting'})"
            )  # fmt: skip
        else:
            api_ok, api = self.health.reachable, self.health.describe()
        if not api_ok:
            api += "; routes kept as they are"
        if self.role in ("removed", "removing"):
            return False, (
                f"removed from this node by `nodeplug install-cni --uninstall` ({self.marker} exists); not managed "
                "until `nodeplug install-cni` runs again"
            )
        if self.role in ("waiting", "error"):
            return False, f"not managed: its lock {self.lock.path} is held by another process (or unusable); {api}"
        own = self.nodes.get(self.node)
        if self.synced and own is None:
            return False, f"node {self.node} is not in the API server: check --node-name (or NODE_NAME)"
        if own is not None and not own.pod_cidrs:
            return False, f"node {self.node} has no spec.podCIDRs: {CURE.format(node=self.node)}"
        o = self.outcome
        written = self._subnets
        if written is not None and written.pod_cidrs:
            cidrs = ",".join(written.pod_cidrs)
            if not self.synced:
                return api_ok, f"pod subnets {cidrs} (from the last run); {api}"
            direct = sum(p == "direct" for p in o.paths.values())
            vxlan = sum(p == "vxlan" for p in o.paths.values())
            detail = f"pod subnets {cidrs}; peers direct {direct}, vxlan {vxlan}, unrouted {len(o.unrouted)}"
            if o.own_refused:
                detail += "; refused: " + "; ".join(why for _, why in o.own_refused)
            if o.failed:
                shown = "; ".join(f"{p} IPv{v}: {why}" for (p, v), why in sorted(o.failed.items())[:4])
                return False, f"{detail}; kernel refused routes to {len(o.failed)} peer subnet(s): {shown}; {api}"
            return api_ok, f"{detail}; {api}"
        if o.own_refused:
            return False, "; ".join(f"this node's {why}" for _, why in o.own_refused) + f"; {api}"
        return False, f"waiting for node {self.node}'s podCIDRs from the API server; {api}"
