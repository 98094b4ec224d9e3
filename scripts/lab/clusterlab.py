"""A cluster on one machine for the cluster-network tests and benchmark: a real etcd + kube-apiserver and several
"nodes", each a network namespace running its own ``nodeplug agent``.

Topology (every object lives in namespaces made here; the machine's own network is never touched)::

    lan  192.168.77.0/24, fd77::/64   a bridge in the switch netns: nodes 1..k, the control plane (.250), router (.254)
    far  192.168.78.0/24, fd78::/64   router (.254) <-> the routed node (.4 behind the router)
    out  203.0.113.0/24,  fd99::/64   router (.254) <-> "outside" (.10): a destination beyond the cluster

etcd and kube-apiserver run in the control-plane netns (:mod:`lab.controlplane`); the test talks to the API from
a thread that entered that netns. Each agent gets a service-account token bound to its own Node object
(TokenRequest with ``boundObjectRef`` kind Node), so the RBAC and admission policy of ``daemonset/rbac.yaml`` are
what it runs under. Pods are netns ADDed through each node's CNI entry point. :meth:`Lab.close` removes every
process and namespace, also after a failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from lab.cniexec import exec_plugin
from lab.controlplane import CP_ADDR, Api, ControlPlane, missing_assets
from lab.host import REPO
from lab.netns import Netns
from lab.wait import wait_for

__all__ = ["OUTSIDE", "Lab", "Netns", "Node", "Pod", "missing_assets", "wait_for"]

PYTHON = sys.executable
ENTRY = str(Path(sys.executable).parent / "nodeplug-cni")
ROUTER_LAN, ROUTER_FAR, ROUTER_OUT, OUTSIDE = "192.168.77.254", "192.168.78.254", "203.0.113.254", "203.0.113.10"
SA_NAMESPACE, SA_NAME = "nodeplug-system", "nodeplug"


# ---------------------------------------------------------------- nodes, agents and pods


class Node:
    def __init__(self, lab: Lab, index: int, ns: Netns, ip4: str, ip6: str, pod4: str, pod6: str) -> None:
        self.lab, self.index, self.ns = lab, index, ns
        self.name = f"node-{index}"
        self.ip4, self.ip6, self.pod4, self.pod6 = ip4, ip6, pod4, pod6
        self.root = lab.work / self.name
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = self.root / "agent.yaml"
        self.kubeconfig = self.root / "kubeconfig"
        self.log = self.root / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.mode = "auto"
        self.token = ""

    @property
    def subnets_file(self) -> Path:
        return self.root / "var/lib/nodeplug/cluster/subnets.json"

    def write_config(self, mode: str = "auto", extra: str = "", resync: int = 30) -> None:
        self.mode = mode
        self.config.write_text(
            "http:\n  address: 127.0.0.1:9450\nshutdown_grace_seconds: 2\nlog_level: debug\n"
            "deviceplugin:\n  enabled: false\ncsi:\n  enabled: false\n"
            f"cni:\n  workers: 4\ncluster_network:\n  mode: {mode}\n  resync_seconds: {resync}\n"
            "  cluster_cidrs: [10.244.0.0/16, fd44::/48]\n" + extra
        )

    def start(self) -> None:
        if not self.config.exists():
            self.write_config()
        argv = [PYTHON, "-m", "nodeplug.cli", "agent", "--config", str(self.config), "--root", str(self.root),
                "--kubeconfig", str(self.kubeconfig), "--node-name", self.name]  # fmt: skip
        self.proc = self.ns.popen(argv, self.log, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    def http(self, path: str) -> tuple[int, str]:
        return self.ns.http_get(9450, path)

    def wait_ready(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-4000:]
            status, body = self.http("/readyz")
            if status == 200 and "cni: ready" in body and "cluster_network: ready" in body:
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready in {timeout}s: {status} {body}\n{self.log_tail()}")
            time.sleep(0.1)

    def doctor(self, check: str) -> str:
        """``nodeplug doctor`` run in the node as an operator runs it in the agent's pod: its line for ``check`` (a
        piece of the check's title)."""
        out = self.ns.exec(
            PYTHON, "-m", "nodeplug.cli", "doctor", "--config", str(self.config), "--root", str(self.root),
            "--kubeconfig", str(self.kubeconfig), "--node-name", self.name, check=False, timeout=120,
        )  # fmt: skip
        return next((x for x in out.splitlines() if check in x), f"no line for {check!r} in:\n{out}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""

    def netconf(self, datapath: str = "bridge") -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0", "name": "lab", "type": "nodeplug", "bridge": "nodeplug0", "datapath": datapath,
            "isGateway": True,
            "isDefaultGateway": True, "ipMasq": False, "socket": str(self.root / "run/nodeplug/cni.sock"),
            "ipam": {"type": "nodeplug", "nodeSubnets": str(self.subnets_file),
                     "dataDir": str(self.root / "var/lib/nodeplug/ipam")},
        }  # fmt: skip

    def cni(self, command: str, pod: str, cid: str, args: str = "", datapath: str = "bridge") -> tuple[int, Any]:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": cid, "CNI_NETNS": f"/run/netns/{pod}", "CNI_IFNAME": "eth0",
               "CNI_PATH": "/usr/lib/cni", **({"CNI_ARGS": args} if args else {})}  # fmt: skip
        conf = self.netconf(datapath)
        code, out, _ = exec_plugin(["ip", "netns", "exec", self.ns.name, ENTRY], conf, {**os.environ, **env})
        return code, out


class Pod:
    def __init__(
        self,
        node: Node,
        ns: Netns,
        cid: str,
        result: Any,
        namespace: str = "",
        name: str = "",
        datapath: str = "bridge",
    ) -> None:
        self.node, self.ns, self.cid, self.datapath = node, ns, cid, datapath
        self.namespace, self.name = namespace, name
        ips = [ipaddress.ip_interface(ip["address"]).ip for ip in result["ips"]]
        self.ip4 = str(next(a for a in ips if a.version == 4))
        self.ip6 = str(next(a for a in ips if a.version == 6))
        # the node-side interface the result names first: a routed pod's veth, a bridged pod's bridge
        self.host_veth = next((str(i["name"]) for i in result.get("interfaces", []) if not i.get("sandbox")), "")
        self.mtu = None


class Lab:
    """The whole set-up; use as a context manager or call :meth:`close`."""

    def __init__(self, work: Path, l2_nodes: int = 3, routed: bool = True, extra_l2: int = 0) -> None:
        self.work = work
        self.tag = "npc" + secrets.token_hex(2)
        self.netns: list[Netns] = []
        self.nodes: list[Node] = []
        self.pods: list[Pod] = []
        self.cp: ControlPlane | None = None
        self.l2_nodes, self.routed, self.extra_l2 = l2_nodes, routed, extra_l2

    def __enter__(self) -> Lab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, role: str) -> Netns:
        ns = Netns(f"{self.tag}-{role}")
        self.netns.append(ns)
        return ns

    def link(self, a: Netns, a_if: str, b: Netns, b_if: str) -> None:
        """A veth pair with one end in each namespace (created inside ``a``: nothing appears in the root netns)."""
        a.ip("link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b.name)
        a.ip("link", "set", a_if, "up")
        b.ip("link", "set", b_if, "up")

    def build(self) -> None:
        sw, router, out, cp_ns = self._ns("sw"), self._ns("rt"), self._ns("out"), self._ns("cp")
        sw.ip("link", "add", "br0", "type", "bridge")
        sw.ip("link", "set", "br0", "up")

        def on_lan(ns: Netns, port: str, ip4: str, ip6: str) -> None:
            self.link(ns, "eth0", sw, port)
            sw.ip("link", "set", port, "master", "br0")
            ns.ip("addr", "add", f"{ip4}/24", "dev", "eth0")
            ns.ip("addr", "add", f"{ip6}/64", "dev", "eth0", "nodad")

        on_lan(router, "rt", ROUTER_LAN, "fd77::254")
        on_lan(cp_ns, "cp", CP_ADDR, "fd77::250")
        self.link(router, "out", out, "eth0")
        router.ip("addr", "add", f"{ROUTER_OUT}/24", "dev", "out")
        router.ip("addr", "add", "fd99::254/64", "dev", "out", "nodad")
        out.ip("addr", "add", f"{OUTSIDE}/24", "dev", "eth0")
        out.ip("addr", "add", "fd99::10/64", "dev", "eth0", "nodad")
        for ns, gw4, gw6 in ((out, ROUTER_OUT, "fd99::254"), (cp_ns, ROUTER_LAN, "fd77::254")):
            ns.ip("route", "add", "default", "via", gw4)
            ns.ip("-6", "route", "add", "default", "via", gw6)
        router.sysctl("net.ipv4.ip_forward", "1")
        router.sysctl("net.ipv6.conf.all.forwarding", "1")

        count = self.l2_nodes + (1 if self.routed else 0) + self.extra_l2
        for i in range(1, count + 1):
            ns = self._ns(f"n{i}")
            routed = self.routed and i == self.l2_nodes + 1
            if routed:
                self.link(router, "far", ns, "eth0")
                router.ip("addr", "add", f"{ROUTER_FAR}/24", "dev", "far")
                router.ip("addr", "add", "fd78::254/64", "dev", "far", "nodad")
                ip4, ip6, gw4, gw6 = f"192.168.78.{i}", f"fd78::{i}", ROUTER_FAR, "fd78::254"
                ns.ip("addr", "add", f"{ip4}/24", "dev", "eth0")
                ns.ip("addr", "add", f"{ip6}/64", "dev", "eth0", "nodad")
            else:
                ip4, ip6, gw4, gw6 = f"192.168.77.{i}", f"fd77::{i}", ROUTER_LAN, "fd77::254"
                on_lan(ns, f"p{i}", ip4, ip6)
            ns.ip("route", "add", "default", "via", gw4)
            ns.ip("-6", "route", "add", "default", "via", gw6)
            self.nodes.append(Node(self, i, ns, ip4, ip6, f"10.244.{i}.0/24", f"fd44:0:0:{i}::/64"))

        self.cp = ControlPlane(cp_ns, self.work / "cp")
        self.cp.start_etcd()
        api = self.cp.start_apiserver()
        for doc in _rbac_objects():
            api.create(doc)
        api.create({"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": SA_NAME, "namespace": SA_NAMESPACE}})  # fmt: skip

    @property
    def api(self) -> Api:
        assert self.cp is not None
        return self.cp.api

    def register(self, node: Node, with_cidr: bool = True, cidrs: list[str] | None = None) -> None:
        """The Node object (its podCIDRs, or ``cidrs``, unless ``with_cidr`` is False; InternalIPs) and the agent's
        kubeconfig with a service-account token bound to that Node."""
        if cidrs is None:
            cidrs = [node.pod4, node.pod6] if with_cidr else []
        self.api.node(node.name, cidrs, [node.ip4, node.ip6])
        uid = self.api.ok("GET", f"/api/v1/nodes/{node.name}")["metadata"]["uid"]
        bound = {"kind": "Node", "apiVersion": "v1", "name": node.name, "uid": uid}
        req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"expirationSeconds": 86400, "boundObjectRef": bound}}  # fmt: skip
        token = self.api.ok(
            "POST", f"/api/v1/namespaces/{SA_NAMESPACE}/serviceaccounts/{SA_NAME}/token", req
        )["status"]["token"]  # fmt: skip
        node.token = token
        assert self.cp is not None
        node.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "lab",
            "clusters": [{"name": "lab", "cluster": {"server": f"https://{CP_ADDR}:6443",
                                                      "certificate-authority": str(self.cp.ca())}}],
            "users": [{"name": node.name, "user": {"token": token}}],
            "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": node.name}}],
        }))  # fmt: skip

    def pod_netns(self, role: str) -> Netns:
        """A network namespace for a pod (removed with the lab)."""
        return self._ns(role)

    def add_pod(self, node: Node, datapath: str = "bridge") -> Pod:
        ns = self._ns(f"pod{len(self.pods)}")
        cid = f"{self.tag}-{len(self.pods)}"
        code, result = node.cni("ADD", ns.name, cid, datapath=datapath)
        if code != 0:
            raise AssertionError(f"ADD on {node.name}: {result}\n{node.log_tail()}")
        pod = Pod(node, ns, cid, result, datapath=datapath)
        self.pods.append(pod)
        return pod

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """A Namespace and its ``default`` ServiceAccount (no controller-manager here makes it), for pods."""
        self.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}})
        self.api.create({"apiVersion": "v1", "kind": "ServiceAccount",
                         "metadata": {"name": "default", "namespace": name}})  # fmt: skip

    def add_k8s_pod(
        self,
        node: Node,
        namespace: str,
        name: str,
        labels: dict[str, str],
        ports: list[dict[str, Any]] | None = None,
        report: bool = True,
        datapath: str = "bridge",
    ) -> Pod:
        """A pod as a kubelet makes one: the Pod object (bound to ``node``) first, then CNI ADD with its
        ``K8S_POD_*`` arguments, then (``report``) its addresses in the Pod's status."""
        obj = self.api.create({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"nodeName": node.name, "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "none", "ports": ports or []}]},
        })  # fmt: skip
        ns = self._ns(f"pod{len(self.pods)}")
        cid = f"{self.tag}-{len(self.pods)}"
        uid = obj["metadata"]["uid"]
        args = f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_UID={uid}"
        code, result = node.cni("ADD", ns.name, cid, args, datapath)
        if code != 0:
            raise AssertionError(f"ADD on {node.name}: {result}\n{node.log_tail()}")
        pod = Pod(node, ns, cid, result, namespace, name, datapath)
        self.pods.append(pod)
        if report:
            self.report(pod)
        return pod

    def report(self, pod: Pod) -> None:
        """The pod's addresses in its status, as kubelet reports them once the sandbox runs."""
        status = {"status": {"phase": "Running", "podIP": pod.ip4, "podIPs": [{"ip": pod.ip4}, {"ip": pod.ip6}]}}
        self.api.ok("PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status", status,
                    "application/merge-patch+json")  # fmt: skip

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.kill()
        if self.cp is not None:
            with contextlib.suppress(Exception):
                self.cp.close()
        for ns in reversed(self.netns):
            ns.delete()


def _rbac_objects() -> Iterator[dict[str, Any]]:
    """The Namespace, and the cluster network's and Events' RBAC and admission policies from daemonset/ (the real
    manifests)."""
    yield from (d for d in yaml.safe_load_all((REPO / "daemonset/namespace.yaml").read_text()) if d)
    for doc in yaml.safe_load_all((REPO / "daemonset/rbac.yaml").read_text()):
        if doc and doc["metadata"]["name"].startswith(("nodeplug-network", "nodeplug-events")):
            yield doc
