"""The DRA driver on a real Kubernetes 1.32 node: kubelet, scheduler and controller-manager allocate and prepare
claims against the slices the agent publishes, and containerd injects the device through the claim's CDI spec.

The shipped agent config leaves DRA off, so this module turns it on for its tests the way an operator would: the
agent's ConfigMap gets ``deviceplugin.dra.enabled: true`` and a resource ``dratest`` offered through DRA (device
nodes ``/dev/nodeplug-dra-*``), and the DaemonSet is restarted; both are put back afterwards. Each test makes its
own device nodes on the node (character 1,3, like /dev/null) with a name of its own, selects them by ``path`` in
its claims, and removes them after."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

DRIVER = "devices.nodeplug.io"
CLASS = f"dratest.{DRIVER}"
CDI_DIR = Path("/var/run/cdi")


@pytest.fixture(scope="module", autouse=True)
def dra_on(cluster: Cluster) -> Iterator[None]:
    ds = cluster.get("-n", "nodeplug-system", "daemonset", "nodeplug")
    (cm_name,) = [v["configMap"]["name"] for v in ds["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    cm = cluster.get("-n", "nodeplug-system", "configmap", cm_name)
    original = cm["data"]["agent.yaml"]
    cfg = yaml.safe_load(original)
    dp = cfg.setdefault("deviceplugin", {})
    dp.setdefault("dra", {})["enabled"] = True
    dp.setdefault("resources", []).append({"name": "dratest", "devices": ["/dev/nodeplug-dra-*"], "offer": "dra"})

    def put(text: str) -> None:
        obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": cm_name, "namespace": "nodeplug-system"},
               "data": {**cm["data"], "agent.yaml": text}}  # fmt: skip
        cluster.kubectl("replace", "-f", "-", input=json.dumps(obj))
        cluster.kubectl("-n", "nodeplug-system", "rollout", "restart", "daemonset/nodeplug")
        cluster.rollout()

    put(yaml.safe_dump(cfg, sort_keys=False))
    try:
        yield
    finally:
        put(original)


@pytest.fixture
def devnodes() -> Iterator[Callable[[], str]]:
    """Factory for device nodes /dev/nodeplug-dra-<random> on the node; each removed after the test."""
    made: list[Path] = []

    def make() -> str:
        p = Path("/dev") / f"nodeplug-dra-{secrets.token_hex(3)}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made.append(p)
        return str(p)

    yield make
    for p in made:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@pytest.fixture
def device_class(cluster: Cluster) -> Iterator[str]:
    obj = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "DeviceClass",
        "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression": (
            f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].resource == 'dratest'")}}]},
    }  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    yield CLASS
    cluster.kubectl("delete", "deviceclass", CLASS, "--ignore-not-found", check=False)


def slice_devices(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Device name -> attributes, over this driver's slices of the node."""
    out: dict[str, dict[str, Any]] = {}
    for s in cluster.get("resourceslices")["items"]:
        if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == cluster.node:
            for d in s["spec"]["devices"]:
                out[d["name"]] = {k: next(iter(v.values())) for k, v in d["basic"]["attributes"].items()}
    return out


def wait_published(cluster: Cluster, path: str, timeout: float = 30) -> str:
    """The pool's device name for ``path``, once the slice lists it."""
    found: list[str] = []

    def probe() -> bool:
        found[:] = [n for n, a in slice_devices(cluster).items() if a.get("path") == path]
        return bool(found)

    cluster.wait(f"{path} in the ResourceSlice", probe, timeout)
    return found[0]


def template(name: str, path: str) -> dict[str, Any]:
    """A ResourceClaimTemplate for one dratest device, the one at ``path``."""
    sel = f"device.attributes['{DRIVER}'].path == '{path}'"
    return {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "dev", "deviceClassName": CLASS, "selectors": [{"cel": {"expression": sel}}]}]}}},
    }  # fmt: skip


def claim_pod(cluster: Cluster, name: str, tmpl: str) -> dict[str, Any]:
    pod = cluster.pod(name, resources={"claims": [{"name": "dev"}]})
    pod["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": tmpl}]
    return pod


def pod_claim(cluster: Cluster, ns: str, pod: str) -> dict[str, Any]:
    status = cluster.get("-n", ns, "pod", pod)["status"]
    (ref,) = status.get("resourceClaimStatuses") or [{}]
    return cluster.get("-n", ns, "resourceclaim", ref["resourceClaimName"])  # type: ignore[no-any-return]


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
