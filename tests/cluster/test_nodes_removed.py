"""A node removed from a cluster of several (``NODEPLUG_TEST_NODES=3``): once its Node object is deleted, the routes
to its pods leave every other node; its kubelet started again registers it anew and the other nodes route to its
podCIDR again. A node's agent killed (SIGKILL, as the kernel's OOM killer ends it): the other nodes' agents and routes
are untouched, pods on every node keep reaching one another, and kubelet starts the agent again. Skipped on a
one-node cluster."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type


def test_a_deleted_nodes_routes_leave_the_other_nodes(cluster: Cluster) -> None:
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster (NODEPLUG_TEST_NODES=1; by default the tier runs on three)")
    gone, *others = cluster.nodes[::-1]
    cidrs = set(cluster.get("node", gone)["spec"]["podCIDRs"])  # one of each family: the tier runs dual stack
    for node in others:
        cluster.wait(f"{node}'s routes to {gone}'s {cidrs}", lambda: cidrs <= set(cluster.cluster_routes(node)), 60)  # noqa: B023
    cluster.kubectl("delete", "node", gone, "--wait=true")
    try:
        for node in others:
            cluster.wait(f"{node}'s routes to the deleted {gone}'s {cidrs} removed",
                         lambda: not cidrs & set(cluster.cluster_routes(node)), 60,  # noqa: B023
                         explain=str(cluster.cluster_routes(node)))  # fmt: skip
    finally:
        # The node comes back as a machine does: its kubelet, started again, registers it.
        cluster.restart(f"kubelet-{gone}")
        cluster.wait(f"{gone} registered again", lambda: bool(cluster.kubectl("get", "node", gone, check=False)), 60)
        cluster.kubectl("wait", "--for=condition=Ready", f"node/{gone}", "--timeout=120s", timeout=150)
        cluster.rollout()
    back = set(cluster.get("node", gone)["spec"]["podCIDRs"])
    for node in others:
        cluster.wait(f"{node}'s routes to {gone}'s {back} again", lambda: back <= set(cluster.cluster_routes(node)), 60)  # noqa: B023


COMMAND = b"nodeplug\0agent\0--config=/etc/nodeplug/agent.yaml\0"  # the DaemonSet's agent container


def agent_processes(cluster: Cluster, node: str) -> list[int]:
    """The pids of the agent (``nodeplug agent``, the DaemonSet's container command) on ``node``: the node's agent pod
    runs in the host's network namespace, which is that node's."""
    netns = os.stat(cluster.namespaces[node]["net"]).st_ino
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            # the console script, run by its interpreter: ".../python3 /usr/local/bin/nodeplug agent --config=..."
            if COMMAND in proc.joinpath("cmdline").read_bytes() and os.stat(proc / "ns" / "net").st_ino == netns:
                pids.append(int(proc.name))
    return pids


def agent_restarts(cluster: Cluster, node: str) -> tuple[str, int]:
    pod = cluster.agent_pod(node)
    statuses = cluster.get("-n", "nodeplug-system", "pod", pod)["status"]["containerStatuses"]
    return pod, next(c["restartCount"] for c in statuses if c["name"] == "agent")


def test_a_nodes_agent_killed_leaves_the_other_nodes_alone(cluster: Cluster, ns: str) -> None:
    if len(cluster.nodes) < 3:
        pytest.skip("needs three nodes (by default the tier runs on three)")
    killed, *others = cluster.nodes[::-1]
    pods = {node: f"p{k}" for k, node in enumerate(cluster.nodes)}
    cluster.apply(ns, *[cluster.pod(pod, nodeSelector={"kubernetes.io/hostname": node}) for node, pod in pods.items()])
    cluster.wait_running(ns, *pods.values())
    ips = {pod: cluster.get("-n", ns, "pod", pod)["status"]["podIP"] for pod in pods.values()}
    cidrs = {node: set(cluster.get("node", node)["spec"]["podCIDRs"]) for node in cluster.nodes}
    before = {node: agent_restarts(cluster, node) for node in others}
    victim = agent_restarts(cluster, killed)
    routes = {node: cluster.cluster_routes(node) for node in others}

    (pid,) = agent_processes(cluster, killed)
    os.kill(pid, signal.SIGKILL)
    cluster.wait(f"{killed}'s agent (pid {pid}) gone", lambda: not Path(f"/proc/{pid}").exists(), 30)

    # While it is down and while kubelet starts it again: the other nodes keep their agents and their routes, every
    # node's pods (the killed agent's node's included: its kernel state is its own) still reach one another.
    for node in others:
        assert agent_restarts(cluster, node) == before[node]
        assert cluster.cluster_routes(node) == routes[node], f"{node}'s routes changed when {killed}'s agent died"
    for a, b in itertools.permutations(pods.values(), 2):
        assert " 0% packet loss" in cluster.exec(ns, a, "ping", "-c", "2", "-W", "2", ips[b]), f"{a} -> {b}"

    cluster.wait(f"{killed}'s agent started again by kubelet", lambda: agent_restarts(cluster, killed)[1] > victim[1],
                 120)  # fmt: skip
    cluster.rollout()
    for node in others:
        assert agent_restarts(cluster, node) == before[node]
        assert cidrs[killed] <= set(cluster.cluster_routes(node)), f"{node} lost a route to {killed}'s pods"
    for a, b in itertools.permutations(pods.values(), 2):
        assert " 0% packet loss" in cluster.exec(ns, a, "ping", "-c", "2", "-W", "2", ips[b]), f"{a} -> {b}"
