"""What a reconcile pass of the cluster network found, and how it is told: the pass's :class:`Outcome` (for
readiness and the doctor), the plugin's :class:`Metrics`, and :class:`Findings`, which turns an outcome into metrics
every pass and into one log line and one Kubernetes Event per new finding (each said once while it lasts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

from cni.cluster.model import IPNetwork, Vtep
from cni.redirect.manager import Counters
from nodeplug.kube.events import EventRecorder, Regarding
from nodeplug.log import Logger
from nodeplug.metrics import RPC_BUCKETS


class Metrics:
    """The cluster network's collectors: made with the plugin, added to the agent's registry while it runs (so that
    a plugin stopped and started again by a config reload registers them again without clashing)."""

    def __init__(self) -> None:
        self.pass_seconds = Histogram(
            "nodeplug_cluster_reconcile_seconds", "Cluster network reconcile passes, by kind (full or incremental).",
            ["kind"], buckets=RPC_BUCKETS, registry=None,
        )  # fmt: skip
        self.changed = Counter(
            "nodeplug_cluster_kernel_changes",
            "Routes, FDB and neighbour entries set or deleted, by outcome (done, or failed: the kernel refused it).",
            ["outcome"],
            registry=None,
        )
        self.withdrawn = Counter(
            "nodeplug_cluster_routes_withdrawn",
            "Routes of the agent's protocol withdrawn because the path to the API server ran through them.",
            registry=None,
        )
        self.peers = Gauge("nodeplug_cluster_peer_paths", "Peer pod subnets by path.", ["path"], registry=None)

        self.redirected = Counters()

    def collectors(self) -> tuple[Histogram, Counter, Counter, Gauge, Counters]:
        return (self.pass_seconds, self.changed, self.withdrawn, self.peers, self.redirected)


@dataclass
class Outcome:
    """What one reconcile pass found (for readiness, the doctor and logs)."""

    paths: dict[tuple[str, int], str] = field(default_factory=dict)
    unrouted: dict[tuple[str, int], str] = field(default_factory=dict)
    failed: dict[tuple[str, int], str] = field(default_factory=dict)  # planned, but the kernel refused it
    problems: list[str] = field(default_factory=list)
    refused: bool = False  # the kernel refused a change of this pass (counted in failed or told in problems)
    own_refused: tuple[tuple[IPNetwork, str], ...] = ()
    own_programmed: bool = False  # this node has a pod subnet and every planned change landed
    vtep: Vtep | None = None
    mtu: int | None = None


class Findings:
    """Tells what passes find, on metrics, in the log and as Events (on this Node, or on the peer's Node)."""

    def __init__(self, node: str, metrics: Metrics, log: Logger, events: EventRecorder | None) -> None:
        self.node, self.metrics, self.log, self.events = node, metrics, log, events
        self._said: frozenset[tuple[str, str]] = frozenset()  # (reason, detail) of the findings said already

    def report(self, o: Outcome) -> None:
        """Metrics every pass; a log line and an Event for each new finding (each said once while it lasts)."""
        self.metrics.peers.labels("direct").set(sum(p == "direct" for p in o.paths.values()))
        self.metrics.peers.labels("vxlan").set(sum(p == "vxlan" for p in o.paths.values()))
        self.metrics.peers.labels("none").set(len(o.unrouted) + len(o.failed))
        me = Regarding.node(self.node)
        findings: dict[tuple[str, str], tuple[Regarding, str]] = {}
        for (peer, version), why in o.unrouted.items():
            note = f"IPv{version} pod subnet not routed from node {self.node}: {why}"
            findings[("PodCIDRNotRouted", note)] = (Regarding.node(peer), note)
        for _, why in o.own_refused:
            note = f"{why}: the pod network of this node does not use it, and pods get no address from it"
            findings[("PodCIDRRefused", note)] = (me, note)
        for (peer, version), why in o.failed.items():
            findings[("RouteNotProgrammed", f"peer {peer} IPv{version}: {why}")] = (me, "")
        for p in o.problems:
            reason = "ForeignRouteLeftAlone" if "nodeplug does not own" in p else "ClusterNetworkProblem"
            findings[(reason, p)] = (me, "")
        for reason, text in sorted(set(findings) - self._said):
            regarding, note = findings[(reason, text)]
            self.log.warning("cluster network", finding=reason, detail=text)
            self.event(regarding, reason, note or text)
        self._said = frozenset(findings)

    def event(self, regarding: Regarding, reason: str, note: str) -> None:
        if self.events is not None:
            self.events.emit(regarding, "Warning", reason, note, action="Route")
