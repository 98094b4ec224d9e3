"""The DRA driver on a real Kubernetes 1.32 node: kubelet, scheduler and controller-manager allocate and prepare
claims against the slices the agent publishes, and containerd injects the device through the claim's CDI spec.

DRA is on as shipped; :func:`support.clusterdra.dratest_resource` adds a resource of device nodes for this module.
Each test makes its own device nodes on the node with a name of its own, selects them by ``path`` in its claims,
and removes them after."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from support.clusterdra import CDI_DIR, DRIVER, claim_pod, pod_claim, slice_devices, template, wait_published

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

pytestmark = pytest.mark.usefixtures("dratest_resource")


def test_a_new_device_node_is_in_the_slice(cluster: Cluster, devnodes: Callable[[], str]) -> None:
    """Hotplug reaches the API server (how fast: scripts/bench-dra, hotplug -> ResourceSlice)."""
    devnodes()  # the driver publishes; wait for a first state
    cluster.wait("the driver's slice", lambda: bool(slice_devices(cluster)), 60)
    path = devnodes()
    name = wait_published(cluster, path, timeout=60)
    assert slice_devices(cluster)[name] == {"resource": "dratest", "kind": "node", "path": path}


def test_a_pod_with_a_claim_template_sees_the_device(
    cluster: Cluster, ns: str, devnodes: Callable[[], str], device_class: str
) -> None:
    path = devnodes()
    name = wait_published(cluster, path)
    cluster.apply(ns, template("one", path), claim_pod(cluster, "user", "one"))
    cluster.wait_running(ns, "user")
    out = cluster.exec(ns, "user", "stat", "-c", "%F %t,%T", path)
    assert out.split() == ["character", "special", "file", "1,3"]
    claim = pod_claim(cluster, ns, "user")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"], result["request"]) == (
        DRIVER,
        cluster.node,
        name,
        "dev",
    )
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["user"]
    uid = claim["metadata"]["uid"]
    assert (CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json").exists()
    cluster.kubectl("-n", ns, "delete", "pod", "user", "--wait=true", timeout=120)
    cluster.wait("claim's CDI spec removed", lambda: not (CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json").exists(), 60)


def test_two_pods_one_device(cluster: Cluster, ns: str, devnodes: Callable[[], str], device_class: str) -> None:
    path = devnodes()
    wait_published(cluster, path)
    cluster.apply(ns, template("only", path), claim_pod(cluster, "first", "only"))
    cluster.wait_running(ns, "first")
    cluster.apply(ns, claim_pod(cluster, "second", "only"))

    def refused() -> bool:  # the scheduler tried, and found no device for its claim
        conditions = cluster.get("-n", ns, "pod", "second")["status"].get("conditions") or []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    cluster.wait("the scheduler to refuse the second pod", refused, 120)
    second = cluster.get("-n", ns, "pod", "second")
    assert second["status"]["phase"] == "Pending", second["status"]
    cluster.kubectl("-n", ns, "delete", "pod", "first", "--wait=true", timeout=120)
    cluster.wait_running(ns, "second", timeout=180)
    cluster.exec(ns, "second", "stat", path)


def test_unprepare_after_an_agent_restart_cleans_up(
    cluster: Cluster, ns: str, devnodes: Callable[[], str], device_class: str
) -> None:
    path = devnodes()
    wait_published(cluster, path)
    cluster.apply(ns, template("t", path), claim_pod(cluster, "user", "t"))
    cluster.wait_running(ns, "user")
    uid = pod_claim(cluster, ns, "user")["metadata"]["uid"]
    spec = CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json"
    assert spec.exists()
    agent = cluster.agent_pod()
    # The agent goes away between prepare and unprepare; the pod is deleted meanwhile.
    cluster.kubectl("-n", "nodeplug-system", "delete", "pod", agent, "--grace-period=0", "--force", "--wait=false")
    cluster.kubectl("-n", ns, "delete", "pod", "user", "--wait=false")
    cluster.rollout()
    cluster.wait("pod gone", lambda: not cluster.kubectl("-n", ns, "get", "pod", "user", check=False), 180)
    # kubelet retries NodeUnprepareResources until the new agent has registered and answered it
    cluster.wait("the new agent unprepared the claim and removed its CDI spec", lambda: not spec.exists(), 180)
