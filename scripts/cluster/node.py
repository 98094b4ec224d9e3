"""The nodes and their control plane: cgroups to find every process again, the daemons' configurations, and
starting them (how each node's namespaces are made: scripts/cluster/nodes.py).

Every daemon runs in a network namespace of the cluster: etcd on the control plane's 127.0.0.1; the API server on
0.0.0.0 there, advertising NODE_ADDR; each node's kubelet, containerd and kube-proxy in its own, so host-network pods
(the nodeplug agent) share that namespace and the pod bridge, its masquerading rules and kube-proxy's Service rules all
live and die there. The first node's mount namespace is the host's: kubelet's directory, nodeplug's state and the
CNI binaries are at their real paths, as on any node; every other node has its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from cluster import nodes
from cluster.common import (
    API_PORT,
    CGROUP,
    CLUSTER_CIDR,
    CLUSTER_CIDR6,
    CNI_CONF_DIR,
    NODE_ADDR,
    SERVICE_CIDR,
    ClusterError,
    State,
    log,
    run,
)  # fmt: skip
from cluster.images import PAUSE
from cluster.nodes import Node
from cluster.pki import Pki

FEATURES = "DynamicResourceAllocation=true"


# ---------------------------------------------------------------- cgroups


def cgroup_roots() -> list[Path]:
    """The hierarchies the daemons' cgroup lives in: pids and freezer on cgroup v1, the unified one on v2."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]
    return [base / h for h in ("pids", "freezer") if (base / h / "cgroup.procs").exists()]


def make_cgroups(state: State) -> None:
    """The daemons' cgroup (and so the lock keeper's: a cluster whose DIR was lost is still found and ended)."""
    for root in cgroup_roots():
        d = root / CGROUP
        d.mkdir(exist_ok=True)
        state.add("cgroups", str(d))
    # kubelet (cgroupfs driver) puts pods under /kubepods in every hierarchy; record those it will create.
    for h in Path("/sys/fs/cgroup").iterdir():
        if (h / "cgroup.procs").exists() and not (h / "kubepods").exists():
            state.add("cgroups", str(h / "kubepods"))


def _join_cgroup() -> None:
    for root in cgroup_roots():
        (root / CGROUP / "cgroup.procs").write_text(str(os.getpid()))


# ---------------------------------------------------------------- daemons


def start(
    state: State, name: str, argv: list[str | Path], env: dict[str, str] | None = None, node: Node | None = None
) -> int:
    """Start ``argv`` in the node's namespaces (default: the control plane's) and the cluster's cgroup; its output
    goes to DIR/logs/NAME.log."""
    node = node or nodes.CONTROL_PLANE
    logs = state.dir / "logs"
    logs.mkdir(exist_ok=True)
    with open(logs / f"{name}.log", "ab") as out:
        p = subprocess.Popen(
            node.enter(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_join_cgroup,
        )  # fmt: skip
    pids = state.data.setdefault("pids", {})
    where = state.data.setdefault("where", {})
    assert isinstance(pids, dict) and isinstance(where, dict)
    pids[name] = p.pid
    where[name] = node.name
    state.save()
    time.sleep(0.2)
    if p.poll() is not None:
        raise ClusterError(f"{name} exited at once ({p.returncode}); see {logs / f'{name}.log'}")
    return p.pid


def keep_lock(state: State, fd: int) -> None:
    """Leave a process holding the machine-wide lock until cluster-down ends it."""
    p = subprocess.Popen(["sleep", "infinity"], pass_fds=[fd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=_join_cgroup)  # fmt: skip
    state.data["keeper"] = p.pid
    state.save()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(pid: int, grace: float) -> None:
    with_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.05)
    with_signal(pid, signal.SIGKILL)


def with_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def restart(state: State, name: str, grace: float = 10) -> int:
    """Stop the daemon ``name`` (SIGTERM, SIGKILL after ``grace`` seconds) and start it again with the very command
    line and environment it ran with (read from /proc), as a node's service manager restarts it; the new pid."""
    pids = state.data.get("pids", {})
    pid = pids.get(name) if isinstance(pids, dict) else None
    if not isinstance(pid, int) or not alive(pid):
        raise ClusterError(f"{name} is not running in this cluster")
    proc = Path(f"/proc/{pid}")
    argv: list[str | Path] = [a.decode() for a in proc.joinpath("cmdline").read_bytes().split(b"\0") if a]
    env = dict(e.decode().partition("=")[::2] for e in proc.joinpath("environ").read_bytes().split(b"\0") if e)
    where = state.data.get("where", {})
    node = next((n for n in nodes.from_state(state) if isinstance(where, dict) and where.get(name) == n.name), None)
    log(f"restarting {name}")
    stop(pid, grace)
    return start(state, name, argv, env, node)


# ---------------------------------------------------------------- control plane


def start_apiserver(state: State, bins: dict[str, Path], pki: Pki) -> None:
    d = state.dir
    start(state, "etcd", [
        bins["etcd"], "--name=nodeplug", f"--data-dir={d / 'etcd'}",
        "--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
        "--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
        "--initial-cluster=nodeplug=http://127.0.0.1:2380", "--listen-metrics-urls=http://127.0.0.1:2381",
    ])  # fmt: skip
    start(state, "kube-apiserver", [
        bins["kube-apiserver"], "--etcd-servers=http://127.0.0.1:2379",
        "--bind-address=0.0.0.0", f"--secure-port={API_PORT}", f"--advertise-address={NODE_ADDR}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", f"--cert-dir={d / 'pki'}",
        f"--tls-cert-file={pki.cert('apiserver')}", f"--tls-private-key-file={pki.key('apiserver')}",
        f"--client-ca-file={pki.ca}", f"--token-auth-file={pki.tokens}",
        f"--requestheader-client-ca-file={pki.ca}", "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.cert('front-proxy-client')}",
        f"--proxy-client-key-file={pki.key('front-proxy-client')}",
        f"--kubelet-client-certificate={pki.cert('apiserver-kubelet-client')}",
        f"--kubelet-client-key={pki.key('apiserver-kubelet-client')}",
        "--kubelet-preferred-address-types=InternalIP",
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.dir / 'sa.pub'}", f"--service-account-signing-key-file={pki.key('sa')}",
        "--allow-privileged=true", f"--feature-gates={FEATURES}", "--runtime-config=resource.k8s.io/v1beta1=true",
        "--profiling=false",
    ])  # fmt: skip


def start_controllers(state: State, bins: dict[str, Path], pki: Pki) -> None:
    """kube-controller-manager and kube-scheduler, once the API server serves (they exit when they cannot yet read
    what RBAC's bootstrap grants them)."""
    common = ["--kubeconfig={k}", "--authentication-kubeconfig={k}", "--authorization-kubeconfig={k}",
              "--leader-elect=false", "--bind-address=127.0.0.1", f"--feature-gates={FEATURES}",
              "--profiling=false"]  # fmt: skip
    cm = str(pki.kubeconfig("controller-manager"))
    start(state, "kube-controller-manager", [
        bins["kube-controller-manager"], *[a.format(k=cm) for a in common], "--secure-port=10257",
        f"--service-account-private-key-file={pki.key('sa')}", f"--root-ca-file={pki.ca}",
        "--use-service-account-credentials=true", "--controllers=*",
        f"--flex-volume-plugin-dir={state.dir / 'volume-plugins'}",  # not /usr/libexec/kubernetes on the host
        "--allocate-node-cidrs=true", f"--cluster-cidr={CLUSTER_CIDR},{CLUSTER_CIDR6}",
        "--node-cidr-mask-size-ipv4=24", "--node-cidr-mask-size-ipv6=64",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
    ])  # fmt: skip
    sched = str(pki.kubeconfig("scheduler"))
    start(
        state, "kube-scheduler", [bins["kube-scheduler"], *[a.format(k=sched) for a in common], "--secure-port=10259"]
    )


# ---------------------------------------------------------------- containerd and kubelet


def containerd_config(state: State, shim: Path, node: Node) -> Path:
    rundir = node.run
    cfg = f"""version = 3
root = "{state.dir / node.suffix("containerd")}"
state = "{rundir / "containerd"}"
temp = "{rundir / "tmp"}"
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{rundir / "containerd.sock"}"
[ttrpc]
  address = "{rundir / "containerd.sock.ttrpc"}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{state.dir / node.suffix("containerd-opt")}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE}"

[plugins.'io.containerd.cri.v1.runtime']
  # This machine's root lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{shim}"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = "{rundir / "runc"}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/opt/cni/bin", "/usr/lib/cni"]
    conf_dir = "{CNI_CONF_DIR}"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
"""
    path = state.dir / f"{node.suffix('containerd')}.toml"
    path.write_text(cfg)
    return path


def kubelet_config(state: State, pki: Pki, node: Node) -> Path:
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "0.0.0.0",
        "readOnlyPort": 0,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(pki.ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{node.run / 'containerd.sock'}",
        "cgroupRoot": node.cgroup_root,
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "featureGates": {"DynamicResourceAllocation": True},
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        # The images were imported, not pulled: never collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        # Online volume expansion happens when kubelet next syncs the pod: every 10 s here, not every minute.
        "syncFrequency": "10s",
        "volumePluginDir": str(state.dir / node.suffix("volume-plugins")),
        "podLogsDir": "/var/log/pods",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }  # fmt: skip
    path = state.dir / f"{node.suffix('kubelet')}.json"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def start_node(state: State, bins: dict[str, Path], node: Node) -> None:
    node.run.joinpath("tmp").mkdir(parents=True, exist_ok=True)
    conf = CNI_CONF_DIR if node.first else state.dir / "nodes" / node.name / CNI_CONF_DIR.relative_to("/")
    conf.mkdir(parents=True, exist_ok=True)
    cfg = containerd_config(state, bins["containerd-shim-runc-v2"], node)
    start(state, node.suffix("containerd"), [bins["containerd"], "--config", cfg], node=node)
    sock = node.run / "containerd.sock"
    deadline = time.monotonic() + 30
    while not sock.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"containerd of {node.name}: no socket within 30 s; see {state.dir / 'logs'}")
        time.sleep(0.1)


def import_images(bins: dict[str, Path], archives: list[Path], node: Node) -> None:
    for a in archives:
        run([bins["ctr"], "--address", node.run / "containerd.sock", "-n", "k8s.io", "images", "import", a],
            timeout=600)  # fmt: skip


def start_kubelet(state: State, bins: dict[str, Path], pki: Pki, node: Node) -> None:
    log(f"starting kubelet (node {node.name})")
    kubeconfig = pki.kubeconfig(node.suffix("kubelet"))
    start(state, node.suffix("kubelet"), [
        bins["kubelet"], f"--config={kubelet_config(state, pki, node)}", f"--kubeconfig={kubeconfig}",
        f"--node-ip={node.address},{node.address6}", f"--hostname-override={node.name}", "--v=2",
    ], node=node)  # fmt: skip
