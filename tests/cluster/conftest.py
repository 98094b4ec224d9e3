"""The cluster tier: nodeplug deployed with kubectl on a real one-node Kubernetes 1.32 cluster, used as users use it.

One cluster for the whole tier (package scope), made and removed by the same scripts anyone runs by hand:
``scripts/cluster-up DIR`` (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and containerd
from KUBE_ASSETS; the images built; ``kubectl apply -k tests/cluster/overlay``) and ``scripts/cluster-down DIR``,
which runs even when a test fails. Each test works in a namespace of its own, deleted after it. The tier skips, with
the reason, where the binaries or the tools are absent or when not root.

To reproduce a failure by hand: ``scripts/cluster-up /tmp/c``, then ``KUBECONFIG=/tmp/c/kubeconfig`` and the
kubectl in ``/tmp/c/state.json`` (``"kubectl"``); the daemons' logs are in ``/tmp/c/logs``. With
``NODEPLUG_TEST_CLUSTER=/tmp/c`` the tier runs on that cluster and leaves it running.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import kubeassets
from support.host import REPO
from support.localcluster import Cluster

CLUSTER_UP = REPO / "scripts" / "cluster-up"
CLUSTER_DOWN = REPO / "scripts" / "cluster-down"
LOCK = Path("/run/lock/nodeplug-cluster.lock")  # scripts/cluster/common.py's
NEEDED = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "kube-proxy",
          "containerd", "containerd-shim-runc-v2", "ctr", "crictl", "csi-provisioner", "csi-resizer",
          "csi-snapshotter", "snapshot-controller"]  # fmt: skip
TOOLS = ["podman", "mmdebstrap", "nsenter", "nft", "openssl", "runc", "mkfs.btrfs"]


def lock_holder() -> str:
    """Who holds the machine's cluster lock now, as cluster-up writes it (``DIR (cluster-up pid N)``)."""
    with contextlib.suppress(OSError):
        return LOCK.read_text().strip()
    return ""


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: runs kubelet, containerd and a network namespace"
    if absent := kubeassets.absent(*NEEDED):
        return absent
    tools = [t for t in TOOLS if shutil.which(t) is None]
    if tools:
        return f"not installed: {', '.join(tools)} (scripts/setup installs them)"
    return None


# A test's hang bound in this tier, unless it names its own. It bounds the test itself, not the fixtures it uses:
# the first test's setup brings the cluster up (on a fresh machine it builds every image first, and it waits for the
# machine's cluster lock while another cluster runs), which scripts/cluster-up's own time limit bounds.
TIER_TIMEOUT = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``cluster_last`` (the uninstall) run after the rest of the tier; every test of the tier gets its
    hang bound for its own body only (see :data:`TIER_TIMEOUT`)."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            own = item.get_closest_marker("timeout")
            seconds = own.args[0] if own is not None and own.args else TIER_TIMEOUT
            item.add_marker(pytest.mark.timeout(seconds, func_only=True), append=False)
    # Last within the tier, not the session: pytest finalises the package's cluster when the next item is of another
    # tier, and a cluster_last test after the other tiers would bring a second cluster up for itself.
    mine = [i for i in items if here in i.path.parents]
    if mine:
        at = items.index(mine[0])
        rest = [i for i in items if here not in i.path.parents]
        mine.sort(key=lambda i: i.get_closest_marker("cluster_last") is not None)
        items[:] = rest[:at] + mine + rest[at:]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster_last: runs after every other test of the cluster tier")


# Package scope: the cluster is gone before the next tier starts. Its agent serves the node's real paths (the CNI
# socket /run/nodeplug/cni.sock among them), where tests of other tiers expect no agent.
@pytest.fixture(scope="package")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if reason := skip_reason():
        pytest.skip(reason)
    if existing := os.environ.get("NODEPLUG_TEST_CLUSTER"):  # a cluster made by hand with scripts/cluster-up DIR
        yield Cluster(Path(existing), Path(existing) / "kubeconfig")
        return
    # Not under pytest's temporary directory: every pytest session on the machine prunes old ones, and this one
    # holds the cluster's state while it runs. Removed after a clean teardown; kept (with its logs) after a failure.
    d = Path(tempfile.mkdtemp(prefix="nodeplug-cluster-", dir="/var/tmp"))
    started = time.monotonic()
    # Another cluster on the machine (only one kubelet per machine): wait for it rather than fail.
    env = {**os.environ, "NODEPLUG_CLUSTER_LOCK_WAIT": os.environ.get("NODEPLUG_CLUSTER_LOCK_WAIT", "1800")}
    nodes = os.environ.get("NODEPLUG_TEST_NODES", "3")  # the same tier on N nodes (NODEPLUG_TEST_NODES=1: one)
    p = subprocess.run([str(CLUSTER_UP), str(d), "--nodes", nodes], capture_output=True, text=True, timeout=3600,
                       check=False, env=env)  # fmt: skip
    try:
        if p.returncode != 0:
            pytest.fail(f"scripts/cluster-up failed ({p.returncode}):\n{p.stderr[-4000:]}\nlogs: {d / 'logs'}")
        kubeconfig = Path(p.stdout.strip().splitlines()[-1])
        print(f"\ncluster-up: {time.monotonic() - started:.0f} s")
        yield Cluster(d, kubeconfig)
    finally:
        q = subprocess.run([str(CLUSTER_DOWN), str(d)], capture_output=True, text=True, timeout=600, check=False)
        assert q.returncode == 0, f"scripts/cluster-down failed ({q.returncode}):\n{q.stderr}"
        # Besides what the session's leak check compares (mounts, network namespaces, links, loop devices): the
        # cgroups (removable only once no process is left in them) and the node's directories. Their names are the
        # same for every cluster: once another cluster waiting for the machine's lock has taken it, they are its.
        left = [str(p) for p in (*Path("/sys/fs/cgroup").glob("*/kubepods"), *Path("/sys/fs/cgroup").glob(
            "*/nodeplug-cluster*"), Path("/var/lib/kubelet"), Path("/run/nodeplug-cluster")) if p.exists()]  # fmt: skip
        if left and (holder := lock_holder()) and not holder.startswith(f"{d} "):
            print(f"\n{left} now belong to the next cluster ({holder}): not checked")
        else:
            assert not left, f"scripts/cluster-down left {left}"
        if request.session.testsfailed:
            print(f"\ncluster state and logs kept in {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ns(cluster: Cluster) -> Iterator[str]:
    """A namespace of the test's own, deleted (with everything in it) after the test."""
    name = "t-" + secrets.token_hex(4)
    cluster.kubectl("create", "namespace", name)
    # The admission controller adds the default ServiceAccount asynchronously; pods need it.
    cluster.wait("default ServiceAccount", lambda: bool(cluster.kubectl("-n", name, "get", "sa", "default",
                                                                        check=False)), 30)  # fmt: skip
    yield name
    with contextlib.suppress(Exception):
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
