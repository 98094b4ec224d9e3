"""Registration with the real kubelet, and a kubelet restart, on the cluster tier's node (kubelet 1.32).

kubelet is restarted as a node's service manager restarts it (``scripts/cluster-restart DIR kubelet``: SIGTERM, then
the same command line). On its way up it deletes every socket in ``device-plugins/`` (the agent's among them) and
has forgotten every plugin: the agent serves and registers its device-plugin resources again, and answers the plugin
watcher, which finds the CSI and DRA registration sockets again and announces both drivers anew. Pods that ran
through the restart keep their containers and devices; new pods get a device-plugin device, a DRA claim and a CSI
volume from the restarted kubelet. What is seen of the agent is its ``/metrics``, read through the API server.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from support.clusterdra import claim_pod, template, wait_published

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

pytestmark = pytest.mark.usefixtures("dratest_resource")

REGISTRATION = "/pluginregistration.Registration/NotifyRegistrationStatus"


def announced(cluster: Cluster) -> dict[str, float]:
    """How often kubelet has told each registration socket of the agent that it registered the driver."""
    return {p: cluster.sample("nodeplug_rpc_total", plugin=p, method=REGISTRATION, code="OK") for p in ("csi", "dra")}


def container(cluster: Cluster, ns: str, pod: str) -> tuple[str, int]:
    """(container ID, restart count) of the pod's one container."""
    (status,) = cluster.get("-n", ns, "pod", pod)["status"]["containerStatuses"]
    return status["containerID"], status["restartCount"]


def exec_ok(cluster: Cluster, ns: str, pod: str) -> bool:
    argv = [cluster.kubectl_bin, f"--kubeconfig={cluster.kubeconfig}", "-n", ns, "exec", pod, "--", "true"]
    return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0


def volume_pod(cluster: Cluster, name: str, claim: str) -> list[dict[str, Any]]:
    """A claim of the nodeplug-local StorageClass and a pod mounting it at /data."""
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "nodeplug-local",
                 "resources": {"requests": {"storage": "64Mi"}}},
    }  # fmt: skip
    pod = cluster.pod(name, volumeMounts=[{"name": "data", "mountPath": "/data"}])
    pod["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    return [pvc, pod]


def test_a_kubelet_restart_keeps_pods_and_devices_and_the_plugins_come_back(
    cluster: Cluster, ns: str, devnodes: Callable[[], str], device_class: str
) -> None:
    fuse = {"limits": {"nodeplug.io/fuse": "1"}}
    held = devnodes()
    wait_published(cluster, held)
    cluster.apply(ns, cluster.pod("keeps-fuse", resources=fuse), template("held", held),
                  claim_pod(cluster, "keeps-claim", "held"))  # fmt: skip
    cluster.wait_running(ns, "keeps-fuse", "keeps-claim")
    before = {p: container(cluster, ns, p) for p in ("keeps-fuse", "keeps-claim")}
    registered = cluster.sample("nodeplug_deviceplugin_registrations_total", resource="fuse", result="ok")
    was_announced = announced(cluster)
    assert registered >= 1 and all(n >= 1 for n in was_announced.values()), (registered, was_announced)

    cluster.restart("kubelet")

    cluster.wait("the fuse resource registered with the new kubelet and its stream open", lambda: cluster.sample(
        "nodeplug_deviceplugin_registrations_total", resource="fuse", result="ok") > registered
        and cluster.sample("nodeplug_deviceplugin_streams", resource="fuse") >= 1, 120)  # fmt: skip
    cluster.wait("CSI and DRA announced to the new kubelet",
                 lambda: all(n > was_announced[p] for p, n in announced(cluster).items()), 120)  # fmt: skip
    # A restarted kubelet learns its pods from the API server again before it serves exec for them ("pod does not
    # exist" until then): wait for that, which is kubelet's own start-up, not the plugins'.
    cluster.wait("the restarted kubelet serving exec for its pods",
                 lambda: all(exec_ok(cluster, ns, p) for p in before), 120)  # fmt: skip
    # the pods ran through it: the same containers, never restarted, with their devices
    assert {p: container(cluster, ns, p) for p in before} == before
    assert cluster.exec(ns, "keeps-fuse", "stat", "-c", "%t,%T", "/dev/fuse").strip() == "a,e5"
    assert cluster.exec(ns, "keeps-claim", "stat", "-c", "%t,%T", held).strip() == "1,3"
    # and the restarted kubelet hands out all three kinds to new pods
    fresh = devnodes()
    wait_published(cluster, fresh)
    cluster.apply(ns, cluster.pod("new-fuse", resources=fuse), template("fresh", fresh),
                  claim_pod(cluster, "new-claim", "fresh"), *volume_pod(cluster, "new-volume", "data"))  # fmt: skip
    cluster.wait_running(ns, "new-fuse", "new-claim", "new-volume", timeout=240)
    assert cluster.exec(ns, "new-fuse", "stat", "-c", "%t,%T", "/dev/fuse").strip() == "a,e5"
    assert cluster.exec(ns, "new-claim", "stat", "-c", "%t,%T", fresh).strip() == "1,3"
    cluster.exec(ns, "new-volume", "sh", "-c", "echo kept > /data/f && sync && cat /data/f")
    node = cluster.get("node", cluster.node)
    assert node["status"]["allocatable"]["nodeplug.io/fuse"] == "16"
