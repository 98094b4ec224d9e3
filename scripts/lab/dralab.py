"""The DRA driver's test bench, shared by tests/e2e/test_dra_api.py and scripts/bench-dra: a real kube-apiserver
(DynamicResourceAllocation on, resource.k8s.io/v1beta1 served) and etcd in a network namespace of their own (the
control plane of :mod:`lab.controlplane`), daemonset/'s namespace, service account and dra.yaml applied, a
Node, and the whole agent in that namespace on a temporary root, with a fake /dev of real device nodes and a token
of the agent's service account bound to the Node (so RBAC and the admission policy apply)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from lab.controlplane import CP_ADDR, Api, ControlPlane
from lab.host import REPO, answers
from lab.netns import Netns
from lab.wait import wait_for

NODE = "dra-node"
DRIVER = "devices.nodeplug.io"
NS = "demo"
SLICES = f"/apis/resource.k8s.io/v1beta1/resourceslices?fieldSelector=spec.nodeName%3D{NODE}"
HTTP_PORT = 9450  # the agent's /readyz, in the cluster's network namespace (one agent at a time there)
DRA_FLAGS = ["--feature-gates=DynamicResourceAllocation=true", "--runtime-config=resource.k8s.io/v1beta1=true"]


def start_apiserver(cp: ControlPlane) -> Api:
    """clusterlab's apiserver, with DRA on."""
    return cp.start_apiserver(extra=tuple(DRA_FLAGS))


class Cluster:
    def __init__(self, work: Path, ns: Netns) -> None:
        self.work, self.ns = work, ns
        # a non-loopback address for the apiserver to advertise: a veth pair with both ends in the namespace
        self.ns.ip("link", "add", "d0", "type", "veth", "peer", "name", "d1")
        self.ns.ip("addr", "add", f"{CP_ADDR}/24", "dev", "d0")
        self.ns.ip("link", "set", "d0", "up")
        self.ns.ip("link", "set", "d1", "up")
        self.cp = ControlPlane(self.ns, work / "cp")
        self.cp.start_etcd()
        self.api = start_apiserver(self.cp)
        self.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        for doc in deployed():
            if doc["kind"] == "DeviceClass":
                self.api.ok("POST", "/apis/resource.k8s.io/v1beta1/deviceclasses", doc)
            else:
                self.api.create(doc)
        self.api.node(NODE, [], [CP_ADDR])
        self.node_uid = self.api.ok("GET", f"/api/v1/nodes/{NODE}")["metadata"]["uid"]
        self.token = self.node_token(NODE, self.node_uid)
        self.kubeconfig = work / "kubeconfig"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": f"https://{CP_ADDR}:6443",
                                                           "certificate-authority": str(self.cp.ca())}}],
                    "users": [{"name": "u", "user": {"token": self.token}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )  # fmt: skip

    def node_token(self, node: str, uid: str) -> str:
        """A token of the agent's service account bound to ``node``, as a pod on that node gets (RBAC and the
        admission policy of daemonset/dra.yaml apply to it)."""
        req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"expirationSeconds": 86400,
                        "boundObjectRef": {"kind": "Node", "apiVersion": "v1", "name": node, "uid": uid}}}  # fmt: skip
        doc = self.api.ok("POST", "/api/v1/namespaces/nodeplug-system/serviceaccounts/nodeplug/token", req)
        return str(doc["status"]["token"])

    def slices(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.api.ok("GET", SLICES)["items"]
        return items

    def devices(self) -> dict[str, dict[str, Any]]:
        """Device name -> attributes (plain values), over every slice of the node."""
        out = {}
        for s in self.slices():
            for d in s["spec"]["devices"]:
                out[d["name"]] = {k: next(iter(v.values())) for k, v in d["basic"]["attributes"].items()}
        return out


def deployed() -> Iterator[dict[str, Any]]:
    """The objects of daemonset/ the DRA driver runs under: its namespace and service account, dra.yaml."""
    for name, kinds in (("namespace.yaml", {"Namespace"}), ("rbac.yaml", {"ServiceAccount"}), ("dra.yaml", None)):
        for doc in yaml.safe_load_all((REPO / "daemonset" / name).read_text()):
            if doc and (kinds is None or doc["kind"] in kinds):
                yield doc


class Agent:
    """``nodeplug agent`` in the cluster's netns on a temporary root; devices are /dev/npw* of a fake host."""

    def __init__(self, cluster: Cluster, root: Path) -> None:
        self.cluster, self.root = cluster, root
        self.host = root / "host"
        (self.host / "dev").mkdir(parents=True, exist_ok=True)
        self.config = root / "agent.yaml"
        self.log = root / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.write_config()

    def write_config(
        self, enabled: bool | str = True, offer: str = "both", replicas: int = 1, csi: bool = False
    ) -> None:
        """``enabled``: True, False or "auto"; ``csi``: the CSI driver on too."""
        self.config.write_text(
            f"http: {{address: 127.0.0.1:{HTTP_PORT}}}\nshutdown_grace_seconds: 2\n"
            f"csi: {{enabled: {str(csi).lower()}}}\ncni: {{enabled: false}}\ncluster_network: {{enabled: false}}\n"
            f"deviceplugin:\n  host_root: {self.host}\n  dra: {{enabled: {str(enabled).lower()}}}\n"
            f"  resources:\n    - {{name: widget, devices: ['/dev/npw*'], offer: {offer}, replicas: {replicas}}}\n"
        )

    def http(self, path: str) -> tuple[int, str]:
        """GET ``path`` from the agent's health server (in the cluster's namespace); (0, error) when it does not
        answer."""
        return self.cluster.ns.http_get(HTTP_PORT, path)

    def mknod(self, name: str) -> None:
        os.mknod(self.host / "dev" / name, stat.S_IFCHR | 0o600, os.makedev(1, 3))

    def start(self) -> None:
        argv = [sys.executable, "-m", "nodeplug.cli", "agent", "--config", str(self.config), "--root", str(self.root),
                "--kubeconfig", str(self.cluster.kubeconfig), "--node-name", NODE]  # fmt: skip
        self.proc = self.cluster.ns.popen(argv, self.log)
        reg = self.root / f"var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"
        wait_for("DRA sockets", lambda: (answers(self.dra_socket) and answers(reg)) or self._dead(), timeout=30)

    def _dead(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"agent exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
        return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    @property
    def dra_socket(self) -> Path:
        return self.root / f"var/lib/kubelet/plugins/{DRIVER}/dra.sock"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "var/run/cdi"

    def claim_specs(self) -> list[str]:
        return sorted(p.name for p in self.cdi_dir.glob("k8s.*.json")) if self.cdi_dir.exists() else []


@contextlib.contextmanager
def running_cluster(prefix: str) -> Iterator[Cluster]:
    """A :class:`Cluster` in a network namespace of its own, its work directory under /tmp (short socket paths);
    both removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/tmp"))
    ns = Netns(prefix + uuid.uuid4().hex[:6])
    c: Cluster | None = None
    try:
        c = Cluster(work, ns)
        yield c
    finally:
        if c is not None:
            c.cp.close()
        ns.delete()
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def running_agent(cluster: Cluster) -> Iterator[Agent]:
    """An :class:`Agent` of ``cluster`` on a temporary root (not started), killed and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="npa-", dir="/tmp"))
    a = Agent(cluster, root)
    try:
        yield a
    finally:
        a.kill()
        shutil.rmtree(root, ignore_errors=True)


def make_claim(cluster: Cluster, name: str, device: str | list[str]) -> str:
    """A ResourceClaim allocated (as the scheduler would) to ``device`` (or devices) of this node's pool; returns its
    UID."""
    devices = [device] if isinstance(device, str) else device
    request: dict[str, Any] = {"name": "w", "deviceClassName": f"widget.{DRIVER}"}
    if len(devices) > 1:
        request |= {"allocationMode": "ExactCount", "count": len(devices)}
    obj = cluster.api.create({
        "apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS}, "spec": {"devices": {"requests": [request]}},
    })  # fmt: skip
    results = [{"request": "w", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]
    obj["status"] = {"allocation": {"devices": {"results": results}}}
    cluster.api.ok("PUT", f"/apis/resource.k8s.io/v1beta1/namespaces/{NS}/resourceclaims/{name}/status", obj)
    return str(obj["metadata"]["uid"])
