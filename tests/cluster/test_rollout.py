"""``kubectl rollout restart daemonset/nodeplug`` while pods run: their containers, volumes and addresses are
untouched (the agent's restart is not theirs), and pods made afterwards get volumes and networks as before."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

MOUNT = {"name": "data", "mountPath": "/data"}


def claim(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "nodeplug-local",
                     "resources": {"requests": {"storage": "32Mi"}}}}  # fmt: skip


def with_volume(cluster: Cluster, name: str, claim_name: str) -> dict[str, Any]:
    return cluster.pod(name, volumeMounts=[MOUNT],
                       volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}])  # fmt: skip


def snapshot(cluster: Cluster, ns: str, *pods: str) -> dict[str, tuple[str, str, str, int]]:
    """Per pod: uid, address, container id, restarts."""
    out = {}
    for p in pods:
        obj = cluster.get("-n", ns, "pod", p)
        c = obj["status"]["containerStatuses"][0]
        out[p] = (obj["metadata"]["uid"], obj["status"]["podIP"], c["containerID"], c["restartCount"])
    return out


def ping(cluster: Cluster, ns: str, src: str, dst_ip: str) -> None:
    assert " 0% packet loss" in cluster.exec(ns, src, "ping", "-c", "2", "-W", "2", dst_ip)


def test_rollout_restart_leaves_running_pods_alone(cluster: Cluster, ns: str) -> None:
    cluster.apply(ns, claim("data"), with_volume(cluster, "app", "data"), cluster.pod("peer"))
    cluster.wait_running(ns, "app", "peer")
    cluster.exec(ns, "app", "sh", "-c", "echo before > /data/f && sync")
    before = snapshot(cluster, ns, "app", "peer")
    old_agent = cluster.agent_pod()

    cluster.kubectl("-n", "nodeplug-system", "rollout", "restart", "daemonset/nodeplug")
    cluster.rollout()
    assert cluster.agent_pod() != old_agent

    assert snapshot(cluster, ns, "app", "peer") == before
    assert cluster.exec(ns, "app", "cat", "/data/f").strip() == "before"
    cluster.exec(ns, "app", "sh", "-c", "echo after >> /data/f && sync")
    ping(cluster, ns, "app", before["peer"][1])
    ping(cluster, ns, "peer", before["app"][1])

    # New pods after the restart: a new volume and an address, and they reach the old ones.
    cluster.apply(ns, claim("fresh"), with_volume(cluster, "new", "fresh"))
    cluster.wait_running(ns, "new")
    cluster.exec(ns, "new", "sh", "-c", "echo new > /data/f && sync")
    new_ip = cluster.get("-n", ns, "pod", "new")["status"]["podIP"]
    assert new_ip not in {before["app"][1], before["peer"][1]}
    ping(cluster, ns, "new", before["app"][1])
    ping(cluster, ns, "peer", new_ip)
