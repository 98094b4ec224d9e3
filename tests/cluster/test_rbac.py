"""The DaemonSet's RBAC grants what its containers use: at the end of the tier, no container of any node's agent pod
has been refused by the API server since it started (each rollout of the tier replaces the pods, so this reads what
the last ones logged: every sidecar's informers at start-up, and the work of the tests after the last rollout). The
one refusal expected is csi-snapshotter's probe for VolumeGroupSnapshot objects, which the driver does not offer
(group snapshots are not enabled), and which the sidecar takes for "not installed"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

EXPECTED = "VolumeGroupSnapshot CRDs were not found"


@pytest.mark.cluster_last
def test_no_container_of_the_daemonset_was_refused_by_rbac(cluster: Cluster) -> None:
    pods = [p for p in cluster.get("-n", "nodeplug-system", "pods", "-l", "app.kubernetes.io/name=nodeplug")["items"]
            if not p["metadata"].get("deletionTimestamp")]  # fmt: skip
    assert len(pods) == len(cluster.nodes)
    refused = []
    for pod in pods:
        for container in pod["spec"]["containers"]:
            log = cluster.kubectl("-n", "nodeplug-system", "logs", pod["metadata"]["name"], "-c", container["name"])
            refused += [f"{pod['spec']['nodeName']} {container['name']}: {line[:300]}" for line in log.splitlines()
                        if "forbidden" in line and EXPECTED not in line]  # fmt: skip
    assert not refused, "refused by the API server:\n" + "\n".join(refused[:20])
