"""The agent's policy service: follows NetworkPolicies, Namespaces and Pods cluster-wide, keeps this node's
nftables table in step, and tells the CNI side when a pod's rules are in place.

Three list+watches (:class:`nodeplug.kube.ListWatch`, typed models) feed one :class:`~cni.policy.compile.Compiler`;
every change wakes one reconciler, which computes the ruleset and applies the difference from what the kernel holds
as one ``nft -f`` transaction (the whole table anew, also one transaction, after the first complete lists, a failed
difference, and every ``resync_seconds``). Events that arrive while a pass runs are folded into the next one.

Until all three collections are listed, the kernel's table is left as it is: the rules of the last run keep
enforcing while the agent restarts or the API server is away, and nothing is ever flushed open. While the API server
is away the table stays as it was; only what the CNI side reports (below) changes it.

**The CNI side** (:class:`Attachments`, which the CNI server calls on its worker threads):

- ADD, before it answers: the pod (``K8S_POD_NAMESPACE``/``K8S_POD_NAME``/``K8S_POD_UID``; its Pod exists before the
  runtime calls CNI, only its address is new) gets the new addresses, and the call returns once a pass has put its
  rules in the kernel. A pod the agent does not know (not in its watch yet, and not found by a GET), or an agent not
  yet in step with the API server, gets its addresses quarantined instead (:mod:`cni.policy.quarantine`): no
  traffic through the node until its rules exist, when a pass lets them go in the same transaction.
- DEL (and GC), before the addresses go back to the IPAM: they are quarantined and taken out of every set, so whoever
  gets them next inherits nothing.

A quarantined address is let go only for a pod the agent attached itself, or a Pod of this node (not terminating)
whose status lists it: the one that holds it now.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Namespace, Pod
from lightkube.resources.networking_v1 import NetworkPolicy
from prometheus_client import Counter, Gauge, Histogram

from cni.policy import kernel, quarantine
from cni.policy.compile import DIRECTIONS, SHORT, Compiler, DropLog, h
from cni.policy.config import PolicyConfig
from cni.policy.model import PodInfo, parse_namespace, parse_pod, parse_policy, slim_namespace, slim_pod
from cni.policy.ruleset import Ruleset, diff_script, full_script
from nodeplug.kube import KubeClient, KubeError, ListWatch
from nodeplug.log import Logger
from nodeplug.metrics import RPC_BUCKETS

KINDS = ("NetworkPolicy", "Namespace", "Pod")
COUNTERS_SECONDS = 15.0


class Metrics:
    def __init__(self) -> None:
        self.policies = Gauge("nodeplug_policy_policies", "NetworkPolicies known, cluster-wide and selecting a pod of "
                              "this node (scope=cluster|node).", ["scope"], registry=None)  # fmt: skip
        self.isolated = Gauge("nodeplug_policy_isolated_pods", "Pods of this node isolated, by direction.",
                              ["direction"], registry=None)  # fmt: skip
        self.seconds = Histogram("nodeplug_policy_reconcile_seconds", "Policy passes (compile and apply), by kind "
                                 "(full or diff).", ["kind"], buckets=RPC_BUCKETS, registry=None)  # fmt: skip
        self.passes = Counter("nodeplug_policy_applies", "nft transactions applied, by kind and outcome.",
                              ["kind", "outcome"], registry=None)  # fmt: skip
        self.dropped = Counter("nodeplug_policy_dropped_packets", "Packets dropped by policy, by the namespace of the "
                               "pod protected and direction.", ["namespace", "direction"], registry=None)  # fmt: skip
        self.quarantined = Gauge("nodeplug_policy_quarantined_addresses", "Addresses held in quarantine.",
                                 registry=None)  # fmt: skip

    def collectors(self) -> tuple[Any, ...]:
        return (self.policies, self.isolated, self.seconds, self.passes, self.dropped, self.quarantined)


class PolicyService:
    def __init__(
        self, cfg: PolicyConfig, kube: KubeClient, node: str, log: Logger, metrics: Metrics, marker: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.marker = marker  # the uninstall's request (cni.cluster.uninstall.MARKER): stand down while it exists
        self.removed = False
        self.kube = kube
        self.node = node
        self.log = log.bind(node=node)
        self.metrics = metrics
        self.compiler = Compiler(node, DropLog(cfg.log_rate) if cfg.log_drops else None)
        self.watches: dict[str, ListWatch[Any]] = {
            "NetworkPolicy": ListWatch(kube, NetworkPolicy, log=self.log),
            "Namespace": ListWatch(kube, Namespace, log=self.log, transform=slim_namespace, keep_objects=False),
            "Pod": ListWatch(kube, Pod, log=self.log, transform=slim_pod, keep_objects=False),
        }
        self.synced: dict[str, bool] = dict.fromkeys(KINDS, False)
        self.raw: dict[str, PodInfo] = {}  # pods as the API says (before what the CNI side told)
        self.by_ip: dict[str, set[str]] = {}  # address -> pods whose status lists it
        self.claims: dict[str, tuple[str, str] | None] = {}  # local address -> (pod, uid) by ADD; None: freed by DEL
        self.held: set[str] = set()  # quarantined, as the kernel has it
        self.to_hold: set[str] = set()
        self.have: Ruleset | None = None  # None: the next pass makes the whole table
        self.gen = 0  # bumped by the CNI side's changes
        self.done = 0  # the gen the last successful pass included
        self.failed = ""
        self.applied_at: float | None = None
        self.problems: list[str] = []
        self._dirty = asyncio.Event()
        self._passed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._counted: dict[str, int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="policy-nft")  # every nft change, one at a time
        await self._nft(quarantine.setup)
        self.held = await self._nft(quarantine.held)
        if self.cfg.bridge_netfilter and (problem := kernel.bridge_netfilter()):
            self.problems.append(problem)
            self.log.warning("network policy", problem=problem)
        self._tasks = [asyncio.create_task(self._follow(k), name=f"policy-watch-{k}") for k in KINDS]
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="policy-reconcile"))
        self._tasks.append(asyncio.create_task(self._count_drops(), name="policy-counters"))
        if self.marker is not None:
            self._tasks.append(asyncio.create_task(self._guard(self.marker), name="policy-guard"))
        self.log.info("following NetworkPolicies, Namespaces and Pods", quarantined=len(self.held))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # a transaction under way finishes; the kernel keeps the table
            self._pool = None

    async def _guard(self, marker: Path) -> None:
        """``nodeplug install-cni --uninstall`` asks the agent to stand down: remove both tables and make no pass
        until the request is withdrawn (a new install), then make the whole table again."""
        while True:
            asked = await asyncio.to_thread(marker.exists)
            if asked and not self.removed:
                self.removed = True
                await self._nft(_remove_tables)
                self.have, self.held, self.to_hold = None, set(), set()
                self.log.warning("network policy removed from this node: uninstall requested", marker=str(marker))
            elif not asked and self.removed:
                self.removed = False
                await self._nft(quarantine.setup)
                self._dirty.set()
                self.log.info("network policy back: the uninstall request is gone")
            await asyncio.sleep(0.2)

    async def _nft(self, fn: Any, *args: Any) -> Any:
        assert self._pool is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------ following the API

    async def _follow(self, kind: str) -> None:
        async for ev in self.watches[kind].events():
            if ev.type == "SYNCED":
                if not self.synced[kind]:
                    self.log.info("listed", kind=kind)
                self.synced[kind] = True
                self.have = None if not self.applied_at else self.have
            elif kind == "NetworkPolicy":
                pol = parse_policy(ev.obj) if ev.type != "DELETED" and ev.obj is not None else None
                if pol is not None and pol.problems:
                    self.log.warning("NetworkPolicy fails closed where it does not parse", policy=pol.key,
                                     problems="; ".join(pol.problems))  # fmt: skip
                self.compiler.set_policy(ev.key, pol)
            elif kind == "Namespace":
                ns = parse_namespace(ev.obj) if ev.type != "DELETED" and ev.obj is not None else None
                self.compiler.set_namespace(ev.key, ns)
            else:
                self._set_raw(ev.key, parse_pod(ev.obj) if ev.type != "DELETED" and ev.obj is not None else None)
            self._dirty.set()

    def _set_raw(self, key: str, pod: PodInfo | None) -> None:
        old = self.raw.pop(key, None)
        touched = {key}
        for addr in old.ips if old else ():
            self.by_ip.get(str(addr), set()).discard(key)
        if pod is not None:
            self.raw[key] = pod
            for addr in pod.ips:
                self.by_ip.setdefault(str(addr), set()).add(key)
        else:
            for text in [t for t, c in self.claims.items() if c is not None and c[0] == key]:
                del self.claims[text]
                touched |= self.by_ip.get(text, set())
        self._refresh(touched)

    def _refresh(self, keys: set[str]) -> None:
        for key in keys:
            raw = self.raw.get(key)
            self.compiler.set_pod(key, self._effective(raw) if raw is not None else None)

    def _effective(self, pod: PodInfo) -> PodInfo:
        """The pod with the addresses it holds now: its status's, less those the CNI side gave to another pod or
        freed, and those still quarantined unless it is this node's and running; plus those ADD gave it."""
        ips = []
        for a in pod.ips:
            text = str(a)
            if text not in self.claims:
                if text in self.held and (pod.node != self.node or pod.terminating):
                    continue
            elif not self._claimed_by(self.claims[text], pod):
                continue
            ips.append(a)
        for text, claim in self.claims.items():
            if self._claimed_by(claim, pod):
                a = ipaddress.ip_address(text)
                if a not in ips:
                    ips.append(a)
        if tuple(ips) == pod.ips and pod.node:
            return pod
        return PodInfo(pod.namespace, pod.name, pod.uid, pod.labels, pod.node or self.node, tuple(ips), pod.ports,
                       pod.terminating)  # fmt: skip

    @staticmethod
    def _claimed_by(claim: tuple[str, str] | None, pod: PodInfo) -> bool:
        return claim is not None and claim[0] == pod.key and (not claim[1] or not pod.uid or claim[1] == pod.uid)

    # ------------------------------------------------------------ the CNI side (on the event loop)

    async def attach(self, namespace: str, name: str, uid: str, ips: Sequence[str]) -> str:
        """Give ``ips`` to the pod; "applied" once its rules are in the kernel, else "quarantined"."""
        key = f"{namespace}/{name}"
        for a in ips:
            self.claims[a] = (key, uid)
        if all(self.synced.values()) and (key not in self.raw or (uid and self.raw[key].uid != uid)):
            try:
                async with asyncio.timeout(min(3.0, self.cfg.attach_timeout_seconds / 2)):  # list: RBAC has no get
                    found = await self.kube.list(Pod, namespace=namespace, fields={"metadata.name": name})
                for pod in filter(None, map(parse_pod, found)):
                    if not uid or pod.uid == uid:
                        self._set_raw(key, pod)
            except (KubeError, TimeoutError) as e:
                self.log.info("pod not known yet: its addresses wait in quarantine", pod=key, error=str(e))
        self._refresh({key} | {k for a in ips for k in self.by_ip.get(a, set())})
        if not all(self.synced.values()) or key not in self.raw:
            await self.hold(ips)
            return "quarantined"
        return "applied" if await self._wait_pass() else "quarantined"

    async def detach(self, ips: Sequence[str]) -> None:
        for a in ips:
            self.claims[a] = None
        self._refresh({k for a in ips for k in self.by_ip.get(a, set())})
        await self.hold(ips)

    async def hold(self, ips: Sequence[str]) -> None:
        """Quarantine ``ips``: through the next pass while passes run (with the sets they leave), else at once."""
        if not ips:
            return
        if self.removed:
            return
        if self.applied_at is None or not all(self.synced.values()):
            await self._nft(quarantine.hold, list(ips))
            self.held |= set(ips)
            return
        self.to_hold |= set(ips)
        if not await self._wait_pass():
            await self._nft(quarantine.hold, list(ips))
            self.held |= set(ips)

    async def _wait_pass(self) -> bool:
        self.gen += 1
        gen = self.gen
        self._dirty.set()
        try:
            async with asyncio.timeout(self.cfg.attach_timeout_seconds), self._passed:
                await self._passed.wait_for(lambda: self.done >= gen)
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------ passes

    async def _reconcile_loop(self) -> None:
        last_full = 0.0
        failures = 0
        while True:
            timeout = None
            if self.applied_at is not None:
                timeout = max(self.cfg.resync_seconds - (time.monotonic() - last_full), 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=timeout)
            self._dirty.clear()
            if not all(self.synced.values()) or self.removed:
                continue
            if time.monotonic() - last_full >= self.cfg.resync_seconds:
                self.have = None
            full = self.have is None
            try:
                await self._pass()
            except kernel.KernelError as e:
                failures += 1
                self.failed = str(e)
                self.metrics.passes.labels("full" if full else "diff", "failed").inc()
                self.log.error("policy pass failed; the table stays as it was", full=full, error=str(e)[:2000])
                self.have = None
                with contextlib.suppress(Exception):
                    self.held = await self._nft(quarantine.held)
                if full:
                    await asyncio.sleep(min(30.0, 0.5 * 2**failures))
                self._dirty.set()
                continue
            failures = 0
            self.failed = ""
            if full:
                last_full = time.monotonic()

    async def _pass(self) -> None:
        started = time.monotonic()
        gen = self.gen
        want = self.compiler.ruleset()
        full = self.have is None
        local = {str(a) for p in self.compiler.local_pods() for a in p.ips}
        hold = set(self.to_hold)
        release = (self.held & local) - hold - {a for a, c in self.claims.items() if c is None}
        script = full_script(want) if self.have is None else diff_script(self.have, want)
        script += quarantine.script("add", hold - self.held) + quarantine.script("delete", release)
        await self._nft(kernel.apply, script)
        self.have = want
        self.held = (self.held | hold) - release
        self.to_hold -= hold
        self.applied_at = time.monotonic()
        kind = "full" if full else "diff"
        self.metrics.passes.labels(kind, "done").inc()
        self.metrics.seconds.labels(kind).observe(time.monotonic() - started)
        self._gauges(want)
        if full or release:
            chains, sets, elements = want.size()
            self.log.info("policy table applied", kind=kind, chains=chains, sets=sets, elements=elements,
                          released=len(release), ms=round((time.monotonic() - started) * 1000, 1))  # fmt: skip
        async with self._passed:
            self.done = max(self.done, gen)
            self._passed.notify_all()

    def _gauges(self, want: Ruleset) -> None:
        self.metrics.policies.labels("cluster").set(len(self.compiler.policies))
        active = {c.split("-")[0] for c in want.chains if c.startswith("p")}
        self.metrics.policies.labels("node").set(len(active))
        local = self.compiler.local_pods()
        for d in DIRECTIONS:
            self.metrics.isolated.labels(d).set(sum(1 for p in local if self.compiler.selecting(p, d)))
        self.metrics.quarantined.set(len(self.held))

    async def _count_drops(self) -> None:
        while True:
            await asyncio.sleep(COUNTERS_SECONDS)
            if self._pool is None:
                continue
            try:
                now = await self._nft(kernel.counters)
            except kernel.KernelError:
                continue
            names = {f"drop-{SHORT[d]}-{h(ns)}": (ns, d) for ns in self.compiler.ns_pods for d in DIRECTIONS}
            for name, packets in now.items():
                before = self._counted.get(name, 0)
                delta = packets - before if packets >= before else packets  # made anew: counting from zero
                if delta and name in names:
                    self.metrics.dropped.labels(*names[name]).inc(delta)
            self._counted = now

    # ------------------------------------------------------------ readiness

    def readiness(self) -> tuple[bool, str]:
        if self.removed:
            return False, f"removed from this node by `nodeplug install-cni --uninstall` ({self.marker} exists)"
        waiting = [k for k, v in self.synced.items() if not v]
        held = f"; {len(self.held)} address(es) quarantined" if self.held else ""
        notes = "".join(f"; {p}" for p in self.problems)
        if waiting:
            errors = {w.status.last_error for w in self.watches.values() if w.status.last_error}
            why = f" ({'; '.join(sorted(errors))[:300]})" if errors else ""
            last = "the table of the last run enforces"
            return False, f"listing {', '.join(waiting)} from the API server{why}; {last}{held}{notes}"
        if self.applied_at is None or self.failed:
            return False, f"policy table not applied: {self.failed[:300] or 'first pass under way'}{held}{notes}"
        local = self.compiler.local_pods()
        isolated = {d: sum(1 for p in local if self.compiler.selecting(p, d)) for d in DIRECTIONS}
        api = (
            ""
            if all(w.status.connected for w in self.watches.values())
            else "; API server not answering: policy rules kept as they are"
        )
        return True, (f"{len(self.compiler.policies)} policies; {len(local)} local pods, isolated ingress "
                      f"{isolated['ingress']}, egress {isolated['egress']}{held}{api}{notes}")  # fmt: skip


def _remove_tables() -> None:
    kernel.remove()
    quarantine.remove()
