"""Deploying: ``kubectl apply -k`` and ``rollout status`` as the README says, and what that leaves on the node."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type


def test_apply_and_rollout_status(cluster: Cluster) -> None:
    out = cluster.kubectl("apply", "-k", str(cluster.overlay))
    assert "daemonset.apps/nodeplug" in out
    cluster.rollout()
    ds = cluster.get("-n", "nodeplug-system", "daemonset", "nodeplug")
    assert ds["status"]["numberReady"] == ds["status"]["desiredNumberScheduled"] == len(cluster.nodes)  # one per node
    pod = cluster.get("-n", "nodeplug-system", "pod", cluster.agent_pod())
    statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
    assert set(statuses) == {"agent", "csi-provisioner", "csi-resizer", "csi-snapshotter"}
    assert all(c["ready"] for c in statuses.values()), statuses


def test_the_node_gets_devices_the_driver_and_the_network(cluster: Cluster) -> None:
    # kubelet reports a device plugin's devices with its next node status (every 10 s).
    cluster.wait("nodeplug.io/fuse allocatable", lambda: cluster.get("node", cluster.node)["status"]["allocatable"]
                 .get("nodeplug.io/fuse") == "16", 60)  # fmt: skip
    node = cluster.get("node", cluster.node)
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    csinode = cluster.get("csinode", cluster.node)
    drivers = {d["name"]: d for d in csinode["spec"]["drivers"]}
    assert drivers["local.csi.nodeplug.io"]["topologyKeys"] == ["topology.local.csi.nodeplug.io/node"]
    # The init container installed the CNI entry point (a symlink into its content-addressed build) and the conflist.
    entry = Path("/opt/cni/bin/nodeplug")
    assert entry.is_symlink() and os.access(entry.resolve(), os.X_OK)
    conflist = json.loads(next(cluster.cni_conf_dir.glob("10-nodeplug.conflist")).read_text())
    assert conflist["plugins"][0]["type"] == "nodeplug"


def test_dynamic_resource_allocation_is_served(cluster: Cluster) -> None:
    groups = cluster.kubectl("api-versions").split()
    assert "resource.k8s.io/v1beta1" in groups
    assert "snapshot.storage.k8s.io/v1" in groups
    cluster.kubectl("get", "resourceslices")
