"""scripts/cluster-up DIR: a one-node Kubernetes 1.32 cluster from KUBE_ASSETS with nodeplug deployed on it.

Steps: build the images (cached); take the machine-wide lock; a network namespace for the node; certificates;
etcd, kube-apiserver, kube-controller-manager, kube-scheduler; containerd (images imported) and kubelet; kube-proxy
(nftables mode, see scripts/cluster/proxy.py) until the ``kubernetes`` Service answers at its ClusterIP; a btrfs
filesystem on a loop device for the ``nodeplug-btrfs`` class; the snapshot CRDs and snapshot-controller; then
``kubectl apply -k`` of the test overlay over daemonset/ and ``rollout status``.
Any failure tears down what was made (logs stay in DIR/logs) and exits non-zero. The last line printed is the
kubeconfig's path.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from cluster import assets, down, e2eimages, images, node, nodes, pki, proxy
from cluster.common import (
    CNI_CONF_DIR,
    HOST_PATHS,
    KUBE_ASSETS,
    KUBELET_DIR,
    NETNS,
    REPO,
    RUN,
    SERVICE_CIDR,
    ClusterError,
    State,
    holder_dir,
    log,
    run,
    take_lock,
    wait_for,
)  # fmt: skip

OVERLAY = REPO / "tests" / "cluster" / "overlay"
ADDONS = REPO / "tests" / "cluster" / "addons"
BTRFS = Path("/var/lib/nodeplug/btrfs")
BTRFS_SIZE = 2 << 30


def node_name() -> str:
    return socket.gethostname().split(".")[0].lower()


def kubectl(state: State) -> list[str]:
    return [str(state.data["kubectl"]), f"--kubeconfig={state.dir / 'kubeconfig'}"]


def preflight() -> None:
    if os.geteuid() != 0:
        raise ClusterError("must run as root (kubelet, containerd, network namespaces, mounts)")
    if absent := assets.missing():
        raise ClusterError(f"KUBE_ASSETS={KUBE_ASSETS}: missing {', '.join(absent)}")
    for tool in ("nsenter", "ip", "nft", "openssl", "podman", "mmdebstrap", "mkfs.btrfs", "losetup", "runc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool}: not installed (scripts/setup installs it)")


def leftovers(before: str) -> None:
    """A cluster not taken down leaves these (checked while holding the lock: another cluster's are not leftovers).

    A cluster whose lock keeper is gone (its processes were killed, or the machine's session ended, without
    cluster-down) is an orphan: nobody holds the lock for it. If the lock still names its DIR and that DIR has the
    cluster's state, it is taken down first, as cluster-down would; anything else is refused."""
    orphan = holder_dir(before)
    if _left() and orphan is not None and (orphan / "state.json").is_file():
        log(f"a cluster left at {orphan} without cluster-down (its lock was free): taking it down first")
        down.teardown(orphan)
    if Path(f"/run/netns/{NETNS}").exists() or RUN.exists():
        raise ClusterError(
            f"/run/netns/{NETNS} or {RUN} exists: a cluster was not taken down (scripts/cluster-down DIR)"
        )
    if KUBELET_DIR.exists():
        raise ClusterError(f"{KUBELET_DIR} exists: another kubelet's or a cluster not taken down; remove it first")


def _left() -> bool:
    return Path(f"/run/netns/{NETNS}").exists() or RUN.exists() or KUBELET_DIR.exists()


def record_host_paths(state: State) -> None:
    """Note which host paths the node will create, so cluster-down removes exactly those."""
    for p in HOST_PATHS:
        if not p.exists():
            state.add("created", str(p))


def mount_of(path: Path) -> tuple[str, bool]:
    """The mount point holding ``path`` and whether it propagates (shared)."""
    best, shared = "/", False
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4]
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best):
            best, shared = point, any(f.startswith("shared:") for f in fields[6 : fields.index("-")])
    return best, shared


def share(state: State, path: Path) -> None:
    """Make ``path`` a shared mount if the mount it is on is not, as systemd makes / on any usual node: containerd
    lets a pod mount a host path with propagation (HostToContainer, Bidirectional) only from a shared mount. (kubelet
    does the same to its own directory.)"""
    path.mkdir(parents=True, exist_ok=True)
    point, shared = mount_of(path)
    if shared:
        return
    log(f"{path}: on {point}, a private mount; making it a shared mount of its own")
    run(["mount", "--bind", path, path])
    state.add("mounts", str(path))
    run(["mount", "--make-rshared", path])


def make_btrfs(state: State, n: nodes.Node) -> None:
    """A btrfs filesystem on a loop device at the node's /var/lib/nodeplug/btrfs (its own mount namespace's)."""
    img = state.dir / f"{n.suffix('btrfs')}.img"
    with open(img, "wb") as f:
        f.truncate(BTRFS_SIZE)
    dev = run(["losetup", "-f", "--show", img]).strip()
    state.add("loops", dev)
    run(["mkfs.btrfs", "-q", dev])
    if n.mntns is None:
        BTRFS.mkdir(parents=True, exist_ok=True)
        run(["mount", dev, BTRFS])
        state.add("mounts", str(BTRFS))
    else:  # gone with the node's mount namespace
        run(["nsenter", f"--mount={n.mntns}", "--", "sh", "-ec", f"mkdir -p {BTRFS} && mount {dev} {BTRFS}"])


SNAPSHOT_CRDS = ("volumesnapshots", "volumesnapshotclasses", "volumesnapshotcontents")


def _established(k: list[str]) -> bool:
    """Whether each snapshot CRD has condition Established True. Polled rather than ``kubectl wait``: a CRD just
    made has ``status.conditions: null``, which kubectl wait takes for an error instead of a wait."""
    got = json.loads(run([*k, "get", "-o", "json", *[f"crd/{c}.snapshot.storage.k8s.io" for c in SNAPSHOT_CRDS]]))
    items = got.get("items", [got])  # a List of the three
    established = 0
    for crd in items:
        conditions = (crd.get("status") or {}).get("conditions") or []
        established += any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)
    return established == len(SNAPSHOT_CRDS)


def apply_addons(state: State) -> None:
    k = kubectl(state)
    run([*k, "apply", "-k", KUBE_ASSETS / "csi" / "crd"], timeout=120)
    wait_for("the snapshot CRDs established", lambda: _established(k), 60)
    run([*k, "apply", "-f", ADDONS / "snapshot-controller.yaml"])


BTRFS_OFF = "  btrfs:\n    enabled: false\n"


def write_overlay(state: State) -> Path:
    """DIR/overlay: tests/cluster/overlay (daemonset/ with the local images) and the base's agent config with
    csi.btrfs on the node's btrfs filesystem, so the config is always the base's of this tree."""
    base = (REPO / "daemonset" / "agent.yaml").read_text()
    if base.count(BTRFS_OFF) != 1:
        raise ClusterError(f"daemonset/agent.yaml: expected one {BTRFS_OFF.strip()!r} block under csi to switch on")
    out = state.dir / "overlay"
    out.mkdir(exist_ok=True)
    (out / "agent.yaml").write_text(base.replace(BTRFS_OFF, f"  btrfs:\n    enabled: true\n    path: {BTRFS}\n"))
    (out / "kustomization.yaml").write_text(
        "# scripts/cluster-up: the test overlay, and the agent config with the node's btrfs filesystem.\n"
        f"resources:\n  - {os.path.relpath(OVERLAY, out)}\n"
        "configMapGenerator:\n  - name: nodeplug-config\n    namespace: nodeplug-system\n    behavior: replace\n"
        "    files: [agent.yaml]\n"
    )
    state.data["overlay"] = str(out)
    state.save()
    return out


def deploy_nodeplug(state: State) -> None:
    k = kubectl(state)
    overlay = write_overlay(state)
    log(f"kubectl apply -k {overlay} (tests/cluster/overlay: daemonset/ with local images; btrfs on)")
    run([*k, "apply", "-k", overlay], timeout=120)
    run([*k, "-n", "nodeplug-system", "rollout", "status", "daemonset/nodeplug", "--timeout=180s"], timeout=200)
    run([*k, "wait", "--for=condition=Ready", *[f"node/{n}" for n in state.list("nodes")], "--timeout=120s"],
        timeout=150)  # fmt: skip
    run([*k, "-n", "kube-system", "rollout", "status", "deployment/snapshot-controller", "--timeout=120s"],
        timeout=150)  # fmt: skip


def up(cluster_dir: Path, count: int = 1) -> Path:
    preflight()
    # Binaries and images first: they need no lock (podman serialises its own storage), and are ready when it comes.
    log(f"unpacking binaries from {KUBE_ASSETS}")
    bins = assets.all_binaries()
    archives = [*images.all_images(), *e2eimages.all_images()]  # the suites' images too (scripts/conformance)
    lock, before = take_lock(cluster_dir)
    leftovers(before)
    cluster_dir.mkdir(parents=True, exist_ok=True)
    if (cluster_dir / "state.json").exists():
        raise ClusterError(f"{cluster_dir}/state.json exists: run scripts/cluster-down {cluster_dir} first")
    state = State(cluster_dir)
    names = [n.name for n in nodes.nodes_of(node_name(), count)]
    state.data.update({"dir": str(cluster_dir), "node": names[0], "nodes": names, "cni_conf_dir": str(CNI_CONF_DIR)})
    state.save()
    try:
        node.make_cgroups(state)
        node.keep_lock(state, lock)
        os.close(lock)
        return _up(state, bins, archives)
    except BaseException:
        diagnose(state)
        if os.environ.get("NODEPLUG_CLUSTER_KEEP") == "1":
            log(f"cluster-up failed: left running for a look (NODEPLUG_CLUSTER_KEEP=1); logs in {cluster_dir / 'logs'}")
            raise
        log(f"cluster-up failed: tearing down (logs stay in {cluster_dir / 'logs'})")
        down.teardown(cluster_dir)
        raise


def diagnose(state: State) -> None:
    """What the cluster looked like when a step failed, into DIR/logs/cluster.txt (and the pods' logs)."""
    if "kubectl" not in state.data or not (state.dir / "kubeconfig").exists():
        return
    k = kubectl(state)
    out = []
    for args in (
        ["get", "nodes,pods", "-A", "-o", "wide"],
        ["get", "events", "-A", "--sort-by=.lastTimestamp"],
        ["-n", "nodeplug-system", "describe", "pods"],
        ["-n", "nodeplug-system", "logs", "daemonset/nodeplug", "--all-containers", "--tail=200"],
    ):
        try:
            out.append(f"$ kubectl {' '.join(args)}\n{run([*k, *args], timeout=30)}")
        except ClusterError as e:
            out.append(f"$ kubectl {' '.join(args)}\n{e}")
    (state.dir / "logs").mkdir(exist_ok=True)
    (state.dir / "logs" / "cluster.txt").write_text("\n".join(out))


def _up(state: State, bins: dict[str, Path], archives: list[Path]) -> Path:
    state.data["kubectl"] = str(bins["kubectl"])
    state.data["crictl"] = str(bins["crictl"])
    state.data["containerd_socket"] = str(RUN / "containerd.sock")
    state.save()

    record_host_paths(state)
    RUN.mkdir(parents=True)
    state.add("created", str(RUN))
    every = nodes.from_state(state)
    nodes.make_underlay(state)
    for n in [nodes.CONTROL_PLANE, *every]:
        nodes.make_netns(state, n)
    state.data["netns"] = every[0].netns
    # Where each node's own view of the machine is (tests enter it to read that node's paths and routes).
    state.data["namespaces"] = {n.name: {"net": f"/run/netns/{n.netns}", "mnt": str(n.mntns or ""),
                                         "uts": str(n.utsns or "")} for n in every}  # fmt: skip
    state.save()
    service_ip = SERVICE_CIDR.split("/")[0].rsplit(".", 1)[0] + ".1"
    keys = pki.make(state.dir / "pki", [n.name for n in every], service_ip)
    shutil.copy(keys.kubeconfig("admin"), state.dir / "kubeconfig")

    log("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler")
    node.start_apiserver(state, bins, keys)
    k = kubectl(state)
    wait_for("kube-apiserver /readyz", lambda: run([*k, "get", "--raw", "/readyz"]).strip() == "ok", 90,
             state.dir / "logs" / "kube-apiserver.log")  # fmt: skip
    node.start_controllers(state, bins, keys)
    wait_for("the kubernetes Service's endpoints", lambda: _has_endpoints(k), 60)

    share(state, Path("/var/lib/nodeplug"))
    for n in every:
        log(f"node {n.name}: starting containerd; importing images")
        if not n.first:
            nodes.make_mount_ns(state, n)
            nodes.make_uts_ns(state, n)
            nodes.make_cgroup_root(state, n)
        node.start_node(state, bins, n)
        node.import_images(bins, archives, n)
        make_btrfs(state, n)
        node.start_kubelet(state, bins, keys, n)
    wait_for(f"nodes {', '.join(state.list('nodes'))} registered", lambda: _registered(k) == set(state.list("nodes")),
             90, state.dir / "logs")  # fmt: skip
    for n in every:
        log(f"node {n.name}: starting kube-proxy (nftables mode)")
        proxy.start(state, bins, keys, n)
    for n in every:
        proxy.wait_serving(state, k, n)
        proxy.check_mode(n)

    apply_addons(state)
    deploy_nodeplug(state)
    state.data["ready"] = True
    state.save()
    return state.dir / "kubeconfig"


def _registered(k: list[str]) -> set[str]:
    return {n.removeprefix("node/") for n in run([*k, "get", "nodes", "-o", "name"]).split()}


def _has_endpoints(k: list[str]) -> bool:
    out = json.loads(run([*k, "-n", "default", "get", "endpointslices", "-l", "kubernetes.io/service-name=kubernetes",
                          "-o", "json"]))  # fmt: skip
    return any(e.get("addresses") for s in out["items"] for e in s.get("endpoints", []))
