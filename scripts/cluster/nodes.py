"""How each node of the local cluster is made (``scripts/cluster-up DIR --nodes N``).

Every node is a kubelet, a containerd and a kube-proxy of its own, on one control plane, and needs its own view of
three things the machine has once:

- **Network**: a network namespace per node (``nodeplug-cluster`` for the first, ``nodeplug-cluster-K`` for the
  K-th), each with an ``eth0`` on one underlay, the bridge ``npcluster0`` on the host (198.18.0.1/24; node K is
  198.18.0.(K+2)), its default route via the host. The control plane (etcd, kube-apiserver, controller-manager,
  scheduler) has a namespace of its own on the underlay, ``nodeplug-cluster-cp`` (198.18.0.2), as a dedicated
  control-plane machine: no node's InternalIP is the API server's address, which every agent keeps its lifelines
  to (it routes no pod subnet through such an address).
- **Paths**: kubelet's device-plugin directory is ``/var/lib/kubelet/device-plugins`` whatever its ``--root-dir``,
  and the DaemonSet's hostPath volumes are absolute paths, so each node needs its own ``/var/lib/kubelet``,
  ``/var/lib/nodeplug``, ``/run/nodeplug``, ... The first node uses the machine's own (as a one-node cluster
  does, so that what a test reads at those paths is that node's); every other node runs in a mount namespace of its
  own (kept at ``/run/nodeplug-cluster/mnt/NAME``, as ``ip netns`` keeps network namespaces) where each of
  :data:`NODE_PATHS` is a directory under ``DIR/nodes/NAME`` bind-mounted in place, shared within the namespace
  (kubelet and the agent's containers mount there with propagation), private towards the host.
- **cgroups**: the first node's pods go to ``/kubepods`` (kubelet's default); node K's kubelet has the cgroup root
  ``/nodeplug-cluster-NAME``, so its pods are under ``/nodeplug-cluster-NAME/kubepods``; the daemons of every node
  run in ``/nodeplug-cluster``.
- **Host name**: every other node has a UTS namespace of its own (``/run/nodeplug-cluster/mnt/NAME.uts``) named
  after it; host-network pods share it, so the agent's host name is its node's (the CSI driver's node id is the
  host name unless configured).

What stays shared, as between the nodes of any cluster on one machine: the kernel (loop devices are machine-wide:
each node's agent tells its own by the backing file's device and inode, never by the path sysfs shows), ``/dev``,
``/sys`` and the images' cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.common import (
    CGROUP,
    CNI_CONF_DIR,
    HOST_ADDR,
    HOST_ADDR6,
    HOST_VETH,
    KUBELET_DIR,
    NETNS,
    NODE_ADDR,
    PREFIX,
    PREFIX6,
    RUN,
    State,
    run,
)  # fmt: skip

MNT = RUN / "mnt"  # the persistent mount namespaces of nodes 2..N
# The paths each node has its own of (nodes 2..N: bind mounts in their mount namespace).
NODE_PATHS = [
    KUBELET_DIR,
    Path("/var/lib/nodeplug"),
    Path("/run/nodeplug"),
    Path("/run/cdi"),  # /var/run/cdi (/var/run is /run)
    Path("/opt/cni/bin"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/run/containerd"),
    Path("/run/netns"),
    CNI_CONF_DIR.parent,  # the node's CNI configuration (tests/cluster/overlay)
]


@dataclass(frozen=True)
class Node:
    name: str
    index: int  # 1..N; 0: the control plane's namespace (no kubelet)

    @property
    def first(self) -> bool:
        return self.index == 1

    @property
    def netns(self) -> str:
        return {0: f"{NETNS}-cp", 1: NETNS}.get(self.index, f"{NETNS}-{self.index}")

    @property
    def address(self) -> str:
        return NODE_ADDR if self.index == 0 else f"198.18.0.{self.index + 2}"

    @property
    def address6(self) -> str:
        return f"{HOST_ADDR6.rsplit(':', 1)[0]}:{self.index + 2:x}"

    @property
    def host_veth(self) -> str:
        return f"npcl{self.index}"

    @property
    def mntns(self) -> Path | None:
        return None if self.index <= 1 else MNT / self.name

    @property
    def utsns(self) -> Path | None:
        return None if self.index <= 1 else MNT / f"{self.name}.uts"

    @property
    def run(self) -> Path:
        """Where its containerd keeps sockets and state (the first node's: RUN itself, as before)."""
        return RUN if self.index <= 1 else RUN / self.name

    @property
    def cgroup_root(self) -> str:
        return "/" if self.first else f"/{CGROUP}-{self.name}"

    def suffix(self, daemon: str) -> str:
        """The daemon's name in the cluster's state and logs: ``kubelet`` for the first node, ``kubelet-NAME``."""
        return daemon if self.first else f"{daemon}-{self.name}"

    def enter(self, argv: list[str | Path]) -> list[str]:
        """``argv`` run in this node's network namespace (and mount and UTS namespaces, nodes 2..N)."""
        own = [f"--mount={self.mntns}", f"--uts={self.utsns}"] if self.mntns else []
        return ["nsenter", f"--net=/run/netns/{self.netns}", *own, "--", *[str(a) for a in argv]]


CONTROL_PLANE = Node("control-plane", 0)


def nodes_of(first_name: str, count: int) -> list[Node]:
    return [Node(first_name if k == 1 else f"{first_name}-{k}", k) for k in range(1, count + 1)]


def from_state(state: State) -> list[Node]:
    names = state.list("nodes") or [str(state.data["node"])]
    return [Node(n, k) for k, n in enumerate(names, start=1)]


def make_underlay(state: State) -> None:
    """The bridge every node's ``eth0`` hangs off, with the host's address (the nodes' default gateway)."""
    run(["ip", "link", "add", HOST_VETH, "type", "bridge"])  # cluster-down deletes it by name, recorded or not
    run(["ip", "addr", "add", f"{HOST_ADDR}/{PREFIX}", "dev", HOST_VETH])
    run(["ip", "addr", "add", f"{HOST_ADDR6}/{PREFIX6}", "dev", HOST_VETH, "nodad"])
    run(["ip", "link", "set", HOST_VETH, "up"])


def make_netns(state: State, node: Node) -> None:
    run(["ip", "netns", "add", node.netns])
    state.add("netns_all", node.netns)
    run(["ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns])
    run(["ip", "link", "set", node.host_veth, "master", HOST_VETH, "up"])
    ns = ["ip", "-n", node.netns]
    run([*ns, "link", "set", "lo", "up"])
    run([*ns, "addr", "add", f"{node.address}/{PREFIX}", "dev", "eth0"])
    run([*ns, "addr", "add", f"{node.address6}/{PREFIX6}", "dev", "eth0", "nodad"])
    run([*ns, "link", "set", "eth0", "up"])
    # The routes kubelet and the pod network take for "the node's default interface" (nothing answers beyond it).
    run([*ns, "route", "add", "default", "via", HOST_ADDR])
    run([*ns, "-6", "route", "add", "default", "via", HOST_ADDR6])
    run(["nsenter", f"--net=/run/netns/{node.netns}", "--", "sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
         "net.ipv6.conf.all.forwarding=1"])  # fmt: skip


def make_mount_ns(state: State, node: Node) -> None:
    """Nodes 2..N: a persistent mount namespace with the node's own :data:`NODE_PATHS` (see the module docstring)."""
    assert node.mntns is not None
    if not MNT.is_dir():
        # A persistent mount namespace is a bind mount of its nsfs file, which must sit on a private mount.
        MNT.mkdir(parents=True)
        run(["mount", "--bind", MNT, MNT])
        run(["mount", "--make-private", MNT])
    node.mntns.touch()
    run(["unshare", f"--mount={node.mntns}", "--propagation", "private", "true"])
    state.add("mntns", str(node.mntns))
    script = []
    for p in NODE_PATHS:
        own = state.dir / "nodes" / node.name / p.relative_to("/")
        own.mkdir(parents=True, exist_ok=True)
        if not p.exists():
            p.mkdir(parents=True)
            state.add("created", str(p))
        # What the host has mounted there (its copy, private here) goes first: a bind stacked on it would not be
        # the mount containerd looks up for the path (the first of equal mount points), so never shared.
        script.append(f"if mountpoint -q '{p}'; then umount -R '{p}'; fi")
        script.append(f"mount --bind '{own}' '{p}' && mount --make-rshared '{p}'")
    run(["nsenter", f"--mount={node.mntns}", "--", "sh", "-ec", "\n".join(script)])


def make_uts_ns(state: State, node: Node) -> None:
    """Nodes 2..N: a persistent UTS namespace whose host name is the node's name. A host-network pod (the agent)
    shares its node's: what it takes for the host name (the CSI driver's default node id, its volumes' topology)
    must be that node's, as on any machine of a cluster, not the first node's."""
    assert node.utsns is not None
    node.utsns.touch()
    run(["unshare", f"--uts={node.utsns}", "hostname", node.name])
    state.add("utsns", str(node.utsns))


def make_cgroup_root(state: State, node: Node) -> None:
    """Nodes 2..N: kubelet's cgroup root in every hierarchy (kubelet refuses one that does not exist)."""
    for h in Path("/sys/fs/cgroup").iterdir():
        if (h / "cgroup.procs").exists():
            d = h / node.cgroup_root.lstrip("/")
            d.mkdir(exist_ok=True)
            state.add("cgroups", str(d))
