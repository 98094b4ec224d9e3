"""What scripts/cluster-up and scripts/cluster-down share: paths, names, running commands, the cluster's state file.

One local cluster per machine at a time (one kubelet owns /var/lib/kubelet, the device-plugin directory and the pod
cgroups): the machine-wide lock below is held from cluster-up until cluster-down, by a small keeper process that
cluster-up leaves running.

Standard library only: these scripts run before (and without) the project's virtualenv.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cluster import kubecache

REPO = Path(__file__).resolve().parents[2]
KUBE_ASSETS = kubecache.assets_dir()
CACHE = kubecache.cache_dir()
LOCK = Path("/run/lock/nodeplug-cluster.lock")

# Names on the host. One cluster at a time (the lock), so they are fixed: a crashed cluster is found again by them.
NETNS = "nodeplug-cluster"
HOST_VETH = "npcluster0"  # the underlay: a bridge on the host, every node's eth0 attached (scripts/cluster/nodes.py)
HOST_ADDR = "198.18.0.1"  # RFC 2544 benchmarking range: nothing else on the machine uses it
NODE_ADDR = "198.18.0.2"  # the API server's advertise address (the control plane's namespace: scripts/cluster/nodes.py)
PREFIX = 24
# The underlay's IPv6 (unique local): every node has an address of each family, so the tier runs dual stack.
HOST_ADDR6 = "fd00:198:18::1"
PREFIX6 = 64
RUN = Path("/run/nodeplug-cluster")  # sockets and runtime state (short: unix socket paths must fit 108 bytes)
CGROUP = "nodeplug-cluster"  # the daemons' cgroup (pids and freezer hierarchies); pods go to /kubepods
SERVICE_CIDR = "10.96.0.0/16"
CLUSTER_CIDR = "10.244.0.0/16"  # node podCIDRs (kube-controller-manager --allocate-node-cidrs)
CLUSTER_CIDR6 = "fd44::/56"  # the IPv6 ones, a /64 each; inside the shipped agent.yaml's cluster_cidrs
API_PORT = 6443

# Host paths the node uses; cluster-down removes the ones cluster-up found absent (recorded in the state file).
KUBELET_DIR = Path("/var/lib/kubelet")
HOST_PATHS = [
    KUBELET_DIR,
    Path("/var/lib/nodeplug"),
    Path("/run/nodeplug"),
    Path("/var/run/cdi"),
    Path("/opt/cni/bin"),
    Path("/opt/cni"),
    Path("/var/log/containers"),
    Path("/var/log/pods"),
    Path("/run/containerd"),  # containerd 2 keeps its shims' sockets in /run/containerd/s whatever its state dir
]
CNI_CONF_DIR = RUN / "cni" / "net.d"  # the node's CNI configuration directory (see tests/cluster/overlay)

IMAGE_PREFIX = "localhost/nodeplug-test"


class ClusterError(Exception):
    """A step failed; the message names the step and what to look at."""


def log(msg: str) -> None:
    print(f"cluster: {msg}", file=sys.stderr, flush=True)


def run(
    argv: Sequence[str | Path],
    *,
    timeout: float = 120,
    check: bool = True,
    input: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """Run a command (argument list, no shell) and return its stdout; a failure names the command and its stderr."""
    args = [str(a) for a in argv]
    try:
        p = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, check=False, input=input, env=env, cwd=cwd
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{' '.join(args)}: no answer within {timeout:.0f} s") from e
    except FileNotFoundError as e:
        raise ClusterError(f"{args[0]}: not installed (scripts/setup installs it)") from e
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(args)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-2000:]}")
    return p.stdout


def wait_for(what: str, probe: Callable[[], bool], timeout: float, log_file: Path | None = None) -> None:
    """Poll ``probe`` until it is true; on timeout name ``what`` and the log to read."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except (ClusterError, OSError):
            pass
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
    hint = f" (see {log_file})" if log_file else ""
    raise ClusterError(f"{what}: not within {timeout:.0f} s{hint}")


class State:
    """DIR/state.json: what cluster-up made, so cluster-down (even after a crash half-way) undoes exactly that."""

    def __init__(self, cluster_dir: Path) -> None:
        self.dir = cluster_dir
        self.path = cluster_dir / "state.json"
        self.data: dict[str, object] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def add(self, key: str, value: str) -> None:
        items = self.list(key)
        if value not in items:
            items.append(value)
        self.data[key] = items
        self.save()

    def list(self, key: str) -> list[str]:
        v = self.data.get(key, [])
        return [str(x) for x in v] if isinstance(v, list) else []


def take_lock(cluster_dir: Path) -> tuple[int, str]:
    """Take the machine-wide cluster lock; return its file descriptor and what the lock named before (the DIR of the
    last cluster that held it, or ""). While another cluster holds it, wait up to NODEPLUG_CLUSTER_LOCK_WAIT seconds
    (default 0), then fail naming the holder."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + float(os.environ.get("NODEPLUG_CLUSTER_LOCK_WAIT", "0"))
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = Path(LOCK).read_text().strip() or "another cluster"
            if time.monotonic() < deadline:
                if not said:
                    log(f"waiting for the machine's cluster lock, held by {holder}")
                    said = True
                time.sleep(2)
                continue
        os.close(fd)
        raise ClusterError(
            f"a local cluster is already running on this machine ({holder}); only one kubelet can run per machine: "
            "stop it with scripts/cluster-down DIR first"
        ) from None
    before = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    os.ftruncate(fd, 0)
    os.write(fd, f"{cluster_dir} (cluster-up pid {os.getpid()})\n".encode())
    return fd, before


def holder_dir(holder: str) -> Path | None:
    """The DIR a lock line ``DIR (cluster-up pid N)`` names, if it is one."""
    head, sep, _ = holder.rpartition(" (cluster-up pid ")
    return Path(head) if sep and head.startswith("/") else None


def lock_holder() -> str:
    try:
        return LOCK.read_text().strip()
    except OSError:
        return ""
