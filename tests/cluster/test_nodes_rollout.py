"""``kubectl rollout restart daemonset/nodeplug`` across several real nodes (``NODEPLUG_TEST_NODES=3``) while a TCP
stream runs between pods on two of them: the DaemonSet replaces the agent of every node, one node after another, and
the connection is neither reset nor stalled; the pods keep their containers, their volume (its data readable and
writable) and their device. Skipped on a one-node cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

MOUNT = {"name": "data", "mountPath": "/data"}
PORT = 9000


def claim(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "nodeplug-local",
                     "resources": {"requests": {"storage": "32Mi"}}}}  # fmt: skip


def on(node: str) -> dict[str, Any]:
    return {"nodeSelector": {"kubernetes.io/hostname": node}}


def received(cluster: Cluster, ns: str) -> int:
    return int(cluster.exec(ns, "server", "sh", "-c", "wc -c < /data/recv").strip())


def containers(cluster: Cluster, ns: str, *pods: str) -> dict[str, tuple[str, int]]:
    out = {}
    for p in pods:
        (c,) = cluster.get("-n", ns, "pod", p)["status"]["containerStatuses"]
        out[p] = (c["containerID"], c["restartCount"])
    return out


def test_rollout_across_the_nodes_under_a_running_tcp_stream(cluster: Cluster, ns: str) -> None:
    if len(cluster.nodes) < 2:
        pytest.skip("a one-node cluster (NODEPLUG_TEST_NODES=1; by default the tier runs on three)")
    first, second = cluster.nodes[0], cluster.nodes[-1]
    device = {"limits": {"nodeplug.io/fuse": "1"}}
    # The server (a volume and a device) writes what it receives to its volume; the client sends a line five times a
    # second over one connection and records that the connection ended, if it does. busybox nc ends the connection
    # when its standard input ends, and a container's is empty: the server's is a pipe that stays open.
    serve = (f"sleep 3600 | nc -l -p {PORT} > /data/recv; echo ended > /data/ended; "
             "trap 'exit 0' TERM; sleep 3600 & wait")  # fmt: skip
    server = cluster.pod("server", "sh", "-c", serve, volumeMounts=[MOUNT], resources=device, **on(second),
                         volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}])  # fmt: skip
    cluster.apply(ns, claim("data"), server)
    cluster.wait_running(ns, "server", timeout=180)
    ip = cluster.get("-n", ns, "pod", "server")["status"]["podIP"]
    send = (f"while :; do date; sleep 0.2; done | nc {ip} {PORT}; echo ended > /tmp/ended; "
            "trap 'exit 0' TERM; sleep 3600 & wait")  # fmt: skip
    cluster.apply(ns, cluster.pod("client", "sh", "-c", send, resources=device, **on(first)))
    cluster.wait_running(ns, "client")
    cluster.wait("the stream flowing", lambda: received(cluster, ns) > 0, 60)
    before = containers(cluster, ns, "server", "client")
    agents = {node: cluster.agent_pod(node) for node in cluster.nodes}

    cluster.kubectl("-n", "nodeplug-system", "rollout", "restart", "daemonset/nodeplug")
    cluster.rollout()
    assert all(cluster.agent_pod(node) != agents[node] for node in cluster.nodes), "not every agent was replaced"

    # The same connection still carries data: more arrives, and neither end saw it end.
    count = received(cluster, ns)
    cluster.wait("the stream still flowing after the rollout", lambda: received(cluster, ns) > count, 30)
    assert cluster.exec(ns, "client", "sh", "-c", "cat /tmp/ended 2>/dev/null; true").strip() == ""
    assert cluster.exec(ns, "server", "sh", "-c", "cat /data/ended 2>/dev/null; true").strip() == ""
    assert containers(cluster, ns, "server", "client") == before
    cluster.exec(ns, "server", "sh", "-c", "echo after > /data/after && sync && cat /data/after")
    for pod in ("server", "client"):
        cluster.exec(ns, pod, "sh", "-c", "exec 3<>/dev/fuse")
    cluster.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", timeout=180)
