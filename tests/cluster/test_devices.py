"""A device from the device plugin: a pod asking for ``nodeplug.io/fuse: 1`` gets /dev/fuse; one that does not,
does not."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type


def test_a_pod_with_nodeplug_fuse_sees_dev_fuse(cluster: Cluster, ns: str) -> None:
    limits = {"limits": {"nodeplug.io/fuse": "1"}}
    cluster.apply(ns, cluster.pod("fuse-user", resources=limits), cluster.pod("no-fuse"))
    cluster.wait_running(ns, "fuse-user", "no-fuse")
    # Character device 10,229 (misc/fuse), readable and writable by the container.
    assert cluster.exec(ns, "fuse-user", "stat", "-c", "%F %t,%T", "/dev/fuse").split() == ["character", "special",
                                                                                           "file", "a,e5"]  # fmt: skip
    cluster.exec(ns, "fuse-user", "sh", "-c", "exec 3<>/dev/fuse")
    assert "No such file" in cluster.kubectl("-n", ns, "exec", "no-fuse", "--", "ls", "/dev/fuse", check=False) + \
        cluster.kubectl("-n", ns, "exec", "no-fuse", "--", "sh", "-c", "ls /dev/fuse 2>&1; true")  # fmt: skip
    node = cluster.get("node", cluster.node)
    assert node["status"]["allocatable"]["nodeplug.io/fuse"] == "16"
