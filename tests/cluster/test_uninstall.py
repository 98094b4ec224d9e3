"""The documented uninstall (daemonset/README.md): workloads deleted, ``nodeplug install-cni --uninstall`` in each
agent pod, ``kubectl delete -k``; the node is left without nodeplug's entry point, configuration, sockets, devices,
mounts, loop devices, pod bridge and cluster network (no nftables table of nodeplug's, no ``nodeplug.vx``, no route of
protocol 110, no subnets file). nodeplug is applied again afterwards: its install withdraws the uninstall request
and the agent brings the cluster network back."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

DRIVER = "local.csi.nodeplug.io"


def nodeplug_pvs(cluster: Cluster) -> list[str]:
    return [
        pv["metadata"]["name"] for pv in cluster.get("pv")["items"] if pv["spec"].get("csi", {}).get("driver") == DRIVER
    ]


def workload_namespaces(cluster: Cluster) -> list[str]:
    return [n["metadata"]["name"] for n in cluster.get("namespaces")["items"] if n["metadata"]["name"].startswith("t-")]


@pytest.mark.cluster_last
def test_documented_uninstall_leaves_the_node_clean(cluster: Cluster) -> None:
    # 1. The workloads first (the other tests' namespaces are being deleted): volumes go while the driver runs.
    cluster.wait("workloads gone", lambda: not workload_namespaces(cluster) and not nodeplug_pvs(cluster), 180,
                 explain=f"left: {workload_namespaces(cluster)} {nodeplug_pvs(cluster)}")  # fmt: skip
    try:
        # 2. As the README says, per agent pod; 3. then the objects.
        pods = cluster.kubectl("-n", "nodeplug-system", "get", "pod", "-l", "app.kubernetes.io/name=nodeplug",
                               "-o", "name").split()  # fmt: skip
        assert pods
        for pod in pods:
            cluster.kubectl("-n", "nodeplug-system", "exec", pod, "-c", "agent", "--", "nodeplug", "install-cni",
                            "--uninstall")  # fmt: skip
        cluster.kubectl("delete", "-k", str(cluster.overlay), "--wait=true", timeout=300)

        assert not Path("/opt/cni/bin/nodeplug").exists() and not Path("/opt/cni/bin/nodeplug.d").exists()
        assert not (cluster.cni_conf_dir / "10-nodeplug.conflist").exists()
        assert not Path("/run/nodeplug/cni.sock").exists()
        assert not Path(f"/var/lib/kubelet/plugins/{DRIVER}/csi.sock").exists()
        assert not [p.name for p in Path("/var/lib/kubelet/plugins_registry").iterdir() if "nodeplug" in p.name]
        assert [p.name for p in Path("/var/lib/kubelet/device-plugins").glob("*.sock")] == ["kubelet.sock"]
        assert "kubernetes.io~csi" not in Path("/proc/self/mountinfo").read_text()
        loops = json.loads(subprocess.run(["losetup", "-J", "-l"], capture_output=True, text=True, timeout=30,
                                          check=True).stdout or '{"loopdevices": []}')["loopdevices"]  # fmt: skip
        assert not [d for d in loops if str(d.get("back-file", "")).startswith("/var/lib/nodeplug/")]
        cluster.wait("kubelet forgets the driver", lambda: DRIVER not in {
            d["name"] for d in cluster.get("csinode", cluster.node)["spec"].get("drivers") or []}, 60)  # fmt: skip
        cluster.wait("no nodeplug devices allocatable", lambda: cluster.get("node", cluster.node)["status"]
                     ["allocatable"].get("nodeplug.io/fuse", "0") == "0", 60)  # fmt: skip
        assert not cluster.kubectl("get", "namespace", "nodeplug-system", "--ignore-not-found")
        # The node's network namespace: no pod bridge, no masquerade table, nothing of the cluster network.
        left = network_of_nodeplug(cluster)
        assert left == {"links": [], "tables": [], "routes": [], "subnets": False}, left
        assert Path(MARKER).exists()  # the request stays until the next install
    finally:
        cluster.kubectl("apply", "-k", str(cluster.overlay))
        cluster.rollout()
    # Applied again: the install withdrew the request and the agent manages the cluster network again.
    assert not Path(MARKER).exists()
    cluster.wait("the cluster network back", lambda: (n := network_of_nodeplug(cluster))["subnets"]
                 and "nodeplug.vx" in n["links"] and "table inet nodeplug-cluster" in n["tables"], 60)  # fmt: skip


MARKER = "/run/nodeplug/cluster-network.uninstall"
SERVICES = "table ip nodeplug-cluster-services"  # the test cluster's stand-in for kube-proxy (scripts/cluster/node.py)


def network_of_nodeplug(cluster: Cluster) -> dict[str, Any]:
    """nodeplug's links, nftables tables and routes (protocol 110) in the node's netns, and whether its subnets file
    exists."""

    def run(*argv: str) -> str:
        return subprocess.run(["ip", "netns", "exec", cluster.netns, *argv], capture_output=True, text=True,
                              timeout=30, check=True).stdout  # fmt: skip

    links = [x["ifname"] for x in json.loads(run("ip", "-j", "link") or "[]")]
    return {
        "links": [x for x in links if x in ("nodeplug0", "nodeplug.vx")],
        "tables": [t for t in run("nft", "list", "tables").splitlines() if "nodeplug" in t and t != SERVICES],
        "routes": [r for v in ("-4", "-6") for r in run("ip", v, "route", "show", "proto", "110").splitlines()],
        "subnets": Path("/var/lib/nodeplug/cluster/subnets.json").exists(),
    }
