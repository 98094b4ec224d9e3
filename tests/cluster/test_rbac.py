"""The DaemonSet's RBAC grants what its containers use: after the rest of the tier has run (volumes provisioned,
restored from snapshots, grown; claims prepared; the network followed), no container of any node's agent pod has
been refused by the API server. The one refusal expected is csi-snapshotter's probe for VolumeGroupSnapshot objects,
which the driver does not offer (group snapshots are not enabled), and which the sidecar takes for "not installed"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

EXPECTED = "VolumeGroupSnapshot CRDs were not found"


@pytest.mark.cluster_last
def test_no_container_of_the_daemonset_was_refused_by_rbac(cluster: Cluster) -> None:
    pods = cluster.get("-n", "nodeplug-system", "pods", "-l", "app.kubernetes.io/name=nodeplug")["items"]
    assert len(pods) == len(cluster.nodes)
    refused = []
    for pod in pods:
        for container in pod["spec"]["containers"]:
            log = cluster.kubectl("-n", "nodeplug-system", "logs", pod["metadata"]["name"], "-c", container["name"])
            refused += [f"{pod['spec']['nodeName']} {container['name']}: {line[:300]}" for line in log.splitlines()
                        if "forbidden" in line and EXPECTED not in line]  # fmt: skip
    assert not refused, "refused by the API server:\n" + "\n".join(refused[:20])
