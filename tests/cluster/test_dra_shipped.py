"""The shipped DeviceClasses on a default install, no config edited: DRA turns itself on here (the API server serves
resource.k8s.io/v1beta1, kubelet 1.32 has DynamicResourceAllocation and registers the driver), and fuse and tun are
offered both ways, so a claim for ``fuse.devices.nodeplug.io`` or ``tun.devices.nodeplug.io`` works beside pods
asking ``nodeplug.io/fuse`` through the device plugin. /dev/fuse's 16 replicas are 16 devices of the node's slice,
shared with the device plugin replica by replica: several pods hold fuse claims at once, a replica a claim holds
leaves the node's allocatable ``nodeplug.io/fuse``, and one a device-plugin pod got leaves the slice."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from support.clusterdra import DRIVER, pod_claim

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

FUSE_LIMITS = {"limits": {"nodeplug.io/fuse": "1"}}


def shipped_template(name: str, device_class: str) -> dict[str, Any]:
    """A ResourceClaimTemplate for one device of a shipped DeviceClass, as the README shows it."""
    return {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "dev", "deviceClassName": device_class}]}}},
    }


def claim_pod(cluster: Cluster, name: str, tmpl: str) -> dict[str, Any]:
    pod = cluster.pod(name, resources={"claims": [{"name": "dev"}]})
    pod["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": tmpl}]
    return pod


def pool(cluster: Cluster, resource: str) -> set[str]:
    """The devices of ``resource`` in the node's slices of this driver."""
    out = set()
    for s in cluster.get("resourceslices")["items"]:
        if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == cluster.node:
            for d in s["spec"]["devices"]:
                if d["basic"]["attributes"]["resource"]["string"] == resource:
                    out.add(d["name"])
    return out


def allocatable_fuse(cluster: Cluster) -> str:
    return str(cluster.get("node", cluster.node)["status"]["allocatable"].get("nodeplug.io/fuse"))


def readyz(cluster: Cluster) -> str:
    return cluster.agent_http("/readyz")


def test_fuse_claims_beside_device_plugin_pods(cluster: Cluster, ns: str) -> None:
    every = {f"fuse-fuse-{k}" for k in range(16)}
    cluster.wait("16 fuse devices in the node's slice", lambda: pool(cluster, "fuse") == every, 120)
    ready = readyz(cluster)
    assert "DRA serving" in ready and "DRA off" not in ready, ready
    # three pods through the device plugin: their replicas leave the slice
    cluster.apply(ns, *(cluster.pod(f"dp-{i}", resources=FUSE_LIMITS) for i in range(3)))
    cluster.wait_running(ns, "dp-0", "dp-1", "dp-2")
    cluster.wait("the device plugin's three replicas withheld from the slice", lambda: len(pool(cluster, "fuse")) == 13)
    # a pod with a claim for the shipped DeviceClass runs beside them and sees /dev/fuse
    cluster.apply(ns, shipped_template("fuse", "fuse.devices.nodeplug.io"), claim_pod(cluster, "claim-0", "fuse"))
    cluster.wait_running(ns, "claim-0")
    assert cluster.exec(ns, "claim-0", "stat", "-c", "%F %t,%T", "/dev/fuse").split() == [
        "character", "special", "file", "a,e5"
    ]  # fmt: skip
    cluster.exec(ns, "claim-0", "sh", "-c", "exec 3<>/dev/fuse")
    # four pods hold fuse claims at once, each its own replica of the one /dev/fuse
    cluster.apply(ns, *(claim_pod(cluster, f"claim-{i}", "fuse") for i in (1, 2, 3)))
    cluster.wait_running(ns, "claim-1", "claim-2", "claim-3")
    held = set()
    for i in range(4):
        claim = pod_claim(cluster, ns, f"claim-{i}")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, cluster.node)
        held.add(result["device"])
        cluster.exec(ns, f"claim-{i}", "stat", "/dev/fuse")
    assert len(held) == 4 and held <= every
    # the claims' replicas are taken from the device plugin: 16 - 4 allocatable (the three pods' stay counted)
    cluster.wait("allocatable nodeplug.io/fuse down to 12", lambda: allocatable_fuse(cluster) == "12", 60)
    for i in range(3):
        cluster.exec(ns, f"dp-{i}", "stat", "/dev/fuse")
    # everything given back once the pods are gone
    cluster.kubectl("-n", ns, "delete", "pod", "--all", "--wait=true", timeout=180)
    cluster.wait("allocatable nodeplug.io/fuse back to 16", lambda: allocatable_fuse(cluster) == "16", 120)
    cluster.wait("all 16 back in the slice", lambda: pool(cluster, "fuse") == every, 120)


def test_a_tun_claim_sees_dev_net_tun(cluster: Cluster, ns: str) -> None:
    cluster.apply(ns, shipped_template("tun", "tun.devices.nodeplug.io"), claim_pod(cluster, "tun", "tun"))
    cluster.wait_running(ns, "tun")
    # character device 10,200 (misc/tun)
    assert cluster.exec(ns, "tun", "stat", "-c", "%F %t,%T", "/dev/net/tun").split() == [
        "character", "special", "file", "a,c8"
    ]  # fmt: skip
    cluster.kubectl("-n", ns, "delete", "pod", "tun", "--wait=true", timeout=120)
