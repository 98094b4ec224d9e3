"""scripts/cluster-down DIR: remove everything cluster-up made, whatever state the cluster is in; safe to repeat.

Order: kubelet first (so nothing restarts containers), then every pod sandbox through containerd (CNI DEL, rootfs
unmounted) while it still answers, node by node; then every process in the cluster's cgroups (daemons, shims,
containers); the mounts under the nodes' paths (kubelet's bind mount of its own directory, volume mounts, pod network
namespaces, the mount and UTS namespaces of nodes 2..N under RUN); loop devices backed by files under nodeplug's state
or DIR; the network namespaces of the nodes and the control plane (each node's eth0 with its addresses and routes of
both families, its host-side veth, pod bridge and nftables rules go with them); the underlay bridge with the host's
IPv4 and IPv6 addresses; the cgroups; the host paths cluster-up found absent. The logs in DIR/logs stay.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from cluster import nodes
from cluster.common import (
    CGROUP,
    HOST_VETH,
    KUBELET_DIR,
    LOCK,
    NETNS,
    RUN,
    ClusterError,
    State,
    lock_holder,
    log,
    run,
)  # fmt: skip
from cluster.node import alive, cgroup_roots, stop

# Where the node mounts things: everything mounted below these (and they themselves) is the cluster's.
MOUNT_ROOTS = [KUBELET_DIR, Path("/var/lib/nodeplug"), Path("/run/nodeplug"), RUN]


def _pids_in(cgroup: Path) -> set[int]:
    pids: set[int] = set()
    if not cgroup.exists():
        return pids
    for procs in cgroup.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids |= {int(x) for x in procs.read_text().split()}
    return pids


def cluster_pids(state: State) -> set[int]:
    pids: set[int] = set()
    for root in cgroup_roots():
        pids |= _pids_in(root / CGROUP)
    for cg in state.list("cgroups"):
        if Path(cg).name == "kubepods" or Path(cg).name.startswith(f"{CGROUP}-"):  # the nodes' pods
            pids |= _pids_in(Path(cg))
    pids.discard(os.getpid())
    return pids


def _netns_inodes(pids: set[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
    return inodes


def _mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, root, filesystem type) per mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append((fields[4].replace("\\040", " "), fields[3], fields[sep + 1]))
    return out


def remove_pods(state: State) -> None:
    crictl = str(state.data.get("crictl", ""))
    for node in nodes.from_state(state):
        sock = node.run / "containerd.sock"
        if not crictl or not Path(crictl).is_file() or not sock.exists():
            continue
        with contextlib.suppress(ClusterError):  # in the node's namespaces: CNI DEL and unmounts happen there
            run(node.enter([crictl, f"--runtime-endpoint=unix://{sock}", "--timeout=20s", "rmp", "--all", "--force"]),
                timeout=90)  # fmt: skip


def kill_all(state: State) -> None:
    pids = state.data.get("pids", {})
    assert isinstance(pids, dict)
    order = ("kubelet", "kube-proxy", "containerd", "kube-scheduler", "kube-controller-manager", "kube-apiserver",
             "etcd")  # fmt: skip
    for name in sorted(pids, key=lambda n: next((k for k, d in enumerate(order) if n.startswith(d)), len(order))):
        pid = pids.get(name)
        if isinstance(pid, int) and alive(pid) and _in_cluster(pid):
            stop(pid, 2 if name.startswith("kubelet") else 10)
    keeper = state.data.get("keeper")
    for _ in range(50):
        left = cluster_pids(state) - {keeper}
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    raise ClusterError(f"processes in the cluster's cgroups survive SIGKILL: {sorted(cluster_pids(state) - {keeper})}")


def _in_cluster(pid: int) -> bool:
    """The pid is still one of ours (in the cluster's cgroup), not a recycled number."""
    try:
        return any(f":/{CGROUP}" in line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    except OSError:
        return False


def _all_netns() -> set[str]:
    """The network namespaces some process on the machine is in, as mountinfo names them (``net:[inode]``)."""
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/{entry.name}/ns/net"))
    return out


def unmount_all(state: State, netns_inodes: set[int]) -> None:
    roots = [*MOUNT_ROOTS, state.dir]
    pod_netns = {f"net:[{i}]" for i in netns_inodes}
    # A pod sandbox whose processes had already gone (a pod torn down as the cluster went) leaves containerd's
    # /run/netns/cni-<id> with no process in it: such an orphan is the cluster's too.
    in_use = _all_netns()
    for _ in range(10):
        mine = []
        for point, root, fstype in _mountinfo():
            p = Path(point)
            under = any(p == r or r in p.parents for r in roots)
            orphan = p.name.startswith("cni-") and root not in in_use
            pod_ns = fstype == "nsfs" and p.parent == Path("/run/netns") and (root in pod_netns or orphan)
            if under or pod_ns:
                mine.append(point)
        if not mine:
            return
        for point in sorted(set(mine), key=lambda x: x.count("/"), reverse=True):
            if subprocess.run(["umount", point], capture_output=True, timeout=30, check=False).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)
            if Path(point).parent == Path("/run/netns"):
                with contextlib.suppress(OSError):
                    os.unlink(point)
    raise ClusterError(f"mounts remain under {', '.join(map(str, roots))}")


def detach_loops(state: State) -> None:
    """Loop devices over files under nodeplug's state or DIR: by path, or by the file's inode (a device attached
    from the agent's container names its file below that container's mount, gone with it)."""
    out = run(["losetup", "-J", "-l", "-O", "NAME,BACK-FILE,BACK-INO,BACK-MAJ:MIN"], check=False).strip()
    devices = json.loads(out).get("loopdevices", []) if out else []
    prefixes = ("/var/lib/nodeplug/", f"{state.dir}/")
    ours = set()
    for top in (Path("/var/lib/nodeplug"), state.dir):
        for f in top.rglob("*") if top.is_dir() else []:
            with contextlib.suppress(OSError):
                st = f.lstat()
                ours.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    for d in devices:
        back = str(d.get("back-file") or "").removesuffix(" (deleted)")
        major, _, minor = str(d.get("back-maj:min") or "-1:-1").partition(":")
        ident = (int(major), int(minor), int(str(d.get("back-ino") or -1)))
        if back.startswith(prefixes) or ident in ours or d["name"] in state.list("loops"):
            subprocess.run(["losetup", "-d", d["name"]], capture_output=True, timeout=30, check=False)


def remove_cgroups(state: State) -> None:
    dirs = [Path(c) for c in state.list("cgroups")]
    for d in dirs:
        if not d.exists():
            continue
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            d.rmdir()


def remove_paths(state: State) -> None:
    for p in sorted(state.list("created"), key=len, reverse=True):
        path = Path(p)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    # What the nodeplug init container put into /opt/cni/bin when that directory was already there.
    if "/opt/cni/bin" not in state.list("created"):
        for name in ("nodeplug", "nodeplug.d"):
            p = Path("/opt/cni/bin") / name
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
    every = nodes.from_state(state)
    names = [n.suffix(d) for n in every for d in ("containerd", "containerd-opt", "volume-plugins")]
    names += [f"{n.suffix('btrfs')}.img" for n in every]
    for d in (*names, "etcd", "nodes"):
        p = state.dir / d
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def teardown(cluster_dir: Path) -> None:
    if not (cluster_dir / "state.json").exists():
        log(f"{cluster_dir}: no cluster state here; nothing to do")
        return
    state = State(cluster_dir)
    pids = state.data.get("pids", {})
    assert isinstance(pids, dict)
    for name, pid in pids.items():  # the kubelets first, so that nothing restarts containers
        if name.startswith("kubelet") and isinstance(pid, int) and alive(pid) and _in_cluster(pid):
            stop(pid, 2)
    remove_pods(state)
    inodes = _netns_inodes(cluster_pids(state))
    kill_all(state)
    unmount_all(state, inodes)
    detach_loops(state)
    for netns in {*state.list("netns_all"), *([NETNS] if state.data.get("netns") else [])}:
        subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30, check=False)
    subprocess.run(["ip", "link", "delete", HOST_VETH], capture_output=True, timeout=30, check=False)
    remove_cgroups(state)
    remove_paths(state)
    # Last: the lock keeper (in the cluster's cgroup, which it leaves empty behind it).
    keeper = state.data.get("keeper")
    if isinstance(keeper, int) and alive(keeper) and _in_cluster(keeper):
        stop(keeper, 1)
    remove_cgroups(state)
    with contextlib.suppress(OSError):
        if lock_holder().startswith(f"{cluster_dir} "):
            LOCK.write_text("")
    state.path.rename(cluster_dir / "state.down.json")
    log(f"{cluster_dir}: cluster removed")
