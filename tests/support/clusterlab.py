"""A cluster on one machine for the cluster-network tests and benchmark: a real etcd + kube-apiserver and several
"nodes", each a network namespace running its own ``nodeplug agent``.

Topology (every object lives in namespaces made here; the machine's own network is never touched)::

    lan  192.168.77.0/24, fd77::/64   a bridge in the switch netns: nodes 1..k, the control plane (.250), router (.254)
    far  192.168.78.0/24, fd78::/64   router (.254) <-> the routed node (.4 behind the router)
    out  203.0.113.0/24,  fd99::/64   router (.254) <-> "outside" (.10): a destination beyond the cluster

etcd and kube-apiserver run in the control-plane netns (apiserver on 192.168.77.250:6443, RBAC on, the admin
authenticates with a static token); the test talks to it from a thread that entered that netns. Each agent gets a
service-account token bound to its own Node object (TokenRequest with ``boundObjectRef`` kind Node), so the RBAC
and admission policy of ``daemonset/rbac.yaml`` are what it runs under. Pods are netns ADDed through each node's
CNI entry point. :meth:`Lab.close` removes every process and namespace, also after a failure.

Binaries: ``KUBE_ASSETS`` (default ``../shared/kube`` beside the repository) holds ``etcd.xz`` and
``kube-apiserver.xz``; they are unpacked once into ``build/kube-assets/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "kube-assets"
PYTHON = sys.executable
ENTRY = str(Path(sys.executable).parent / "nodeplug-cni")
ADMIN_TOKEN = "nodeplug-lab-admin-" + "0" * 8
CP_ADDR, ROUTER_LAN, ROUTER_FAR, ROUTER_OUT, OUTSIDE = (
    "192.168.77.250", "192.168.77.254", "192.168.78.254", "203.0.113.254", "203.0.113.10",
)  # fmt: skip
SA_NAMESPACE, SA_NAME = "nodeplug-system", "nodeplug"


def kube_assets() -> Path:
    return Path(os.environ.get("KUBE_ASSETS", REPO.parent / "shared" / "kube"))


def missing_assets() -> str:
    """Why the lab cannot run here ("" when it can)."""
    d = kube_assets()
    if os.geteuid() != 0:
        return "needs root: creates network namespaces"
    for name in ("etcd.xz", "kube-apiserver.xz"):
        if not (d / name).is_file():
            return f"{d / name} is absent (set KUBE_ASSETS to a directory with etcd.xz and kube-apiserver.xz)"
    for tool in ("xz", "openssl", "nft", "ping"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return ""


def binaries() -> Path:
    """etcd and kube-apiserver unpacked into the cache (once per version of the compressed files)."""
    src = kube_assets()
    h = hashlib.sha256()
    for name in ("etcd.xz", "kube-apiserver.xz"):
        st = (src / name).stat()
        h.update(f"{name} {st.st_size} {st.st_mtime_ns}".encode())
    out = CACHE / h.hexdigest()[:12]
    if not (out / "kube-apiserver").exists():
        tmp = CACHE / f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in ("etcd", "kube-apiserver"):
            with open(tmp / name, "wb") as f:
                subprocess.run(["xz", "-dc", str(src / f"{name}.xz")], stdout=f, check=True, timeout=300)
            os.chmod(tmp / name, 0o755)
        try:
            os.rename(tmp, out)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def sh(*argv: str, check: bool = True, timeout: float = 60, input: str | None = None) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


class Netns:
    """A network namespace, and a thread living in it for socket work (sockets keep the netns they are made in)."""

    def __init__(self, name: str) -> None:
        self.name = name
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        self._pool: ThreadPoolExecutor | None = None

    def ip(self, *args: str, check: bool = True) -> str:
        return sh("ip", "-n", self.name, *args, check=check)

    def exec(self, *argv: str, check: bool = True, timeout: float = 60, input: str | None = None) -> str:
        return sh("ip", "netns", "exec", self.name, *argv, check=check, timeout=timeout, input=input)

    def popen(self, argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.name, *argv], stdout=out, stderr=subprocess.STDOUT, **kw
            )

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on this netns's own thread."""
        if self._pool is None:
            fd = os.open(f"/run/netns/{self.name}", os.O_RDONLY)

            def enter() -> None:
                from cni.dataplane.netns import _setns

                _setns(fd)

            self._pool = ThreadPoolExecutor(1, initializer=enter)
        return self._pool.submit(fn, *args).result()

    def sysctl(self, key: str, value: str) -> None:
        self.exec("sysctl", "-qw", f"{key}={value}")

    def delete(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        sh("ip", "netns", "delete", self.name, check=False)


# ---------------------------------------------------------------- the Kubernetes API


class Api:
    """A minimal REST client for the tests, speaking from inside the control-plane netns."""

    def __init__(self, ns: Netns, host: str, port: int, token: str = ADMIN_TOKEN) -> None:
        self.ns, self.host, self.port, self.token = ns, host, port, token
        self._conn: http.client.HTTPSConnection | None = None
        self.ctx = ssl.create_default_context()
        self.ctx.check_hostname = False
        self.ctx.verify_mode = ssl.CERT_NONE

    def request(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> tuple[int, Any]:
        """One request over a kept-alive connection (made again when the server closed it)."""

        def go() -> tuple[int, Any]:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Authorization": f"Bearer {self.token}", "Content-Type": ctype, "Accept": "application/json"}
            for attempt in (1, 2):
                if self._conn is None:
                    self._conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=10)
                try:
                    self._conn.request(method, path, data, headers)
                    resp = self._conn.getresponse()
                    raw = resp.read()
                    break
                except (OSError, http.client.HTTPException):
                    self._conn.close()
                    self._conn = None
                    if attempt == 2:
                        raise
            if "json" not in (resp.getheader("Content-Type") or ""):
                return resp.status, raw.decode(errors="replace")
            return resp.status, json.loads(raw) if raw else None

        return self.ns.call(go)  # type: ignore[no-any-return]

    def close(self) -> None:
        def go() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        with contextlib.suppress(Exception):
            self.ns.call(go)

    def ok(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        status, doc = self.request(method, path, body, ctype)
        if status >= 300:
            raise RuntimeError(f"{method} {path}: {status} {doc}")
        return doc

    def create(self, obj: dict[str, Any]) -> Any:
        kind, ns = obj["kind"], obj.get("metadata", {}).get("namespace")
        group_version = obj["apiVersion"]
        plural = {"ServiceAccount": "serviceaccounts", "Namespace": "namespaces", "Node": "nodes"}.get(kind)
        plural = plural or (kind.lower()[:-1] + "ies" if kind.endswith("y") else kind.lower() + "s")
        base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        path = f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"
        return self.ok("POST", path, obj)

    def node(self, name: str, cidrs: list[str], ips: list[str], annotations: dict[str, str] | None = None) -> Any:
        spec = {"podCIDR": cidrs[0], "podCIDRs": cidrs} if cidrs else {}
        meta: dict[str, Any] = {"name": name, **({"annotations": annotations} if annotations else {})}
        self.create({"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec})
        status = {"status": {"addresses": [{"type": "InternalIP", "address": a} for a in ips]}}
        return self.ok("PATCH", f"/api/v1/nodes/{name}/status", status, "application/merge-patch+json")

    def ready(self) -> bool:
        try:
            status, _ = self.request("GET", "/readyz")
        except OSError:
            return False
        return status == 200


class ControlPlane:
    def __init__(self, ns: Netns, work: Path, bin_dir: Path) -> None:
        self.ns, self.work, self.bin = ns, work, bin_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.apis: list[Api] = []
        work.mkdir(parents=True, exist_ok=True)
        sh("openssl", "genrsa", "-out", str(work / "sa.key"), "2048")
        sh("openssl", "rsa", "-in", str(work / "sa.key"), "-pubout", "-out", str(work / "sa.pub"))
        (work / "tokens.csv").write_text(f"{ADMIN_TOKEN},lab-admin,lab-admin,system:masters\n")
        self.api = self.client(6443)

    def client(self, port: int = 6443, token: str = ADMIN_TOKEN) -> Api:
        """An API client from inside the control-plane netns (closed with the control plane)."""
        api = Api(self.ns, CP_ADDR, port, token)
        self.apis.append(api)
        return api

    def start_etcd(self) -> None:
        data = self.work / "etcd"
        self.procs["etcd"] = self.ns.popen(
            [str(self.bin / "etcd"), "--name", "lab", "--data-dir", str(data),
             "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
             "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "lab=http://127.0.0.1:2380", "--listen-metrics-urls", "http://127.0.0.1:2381",
             "--quota-backend-bytes", str(1 << 30)],
            self.work / "etcd.log",
        )  # fmt: skip

    def start_apiserver(self, name: str = "apiserver", port: int = 6443, extra: tuple[str, ...] = ()) -> Api:
        argv = [
            str(self.bin / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379",
            f"--bind-address={CP_ADDR}", f"--advertise-address={CP_ADDR}", f"--secure-port={port}",
            f"--cert-dir={self.work / ('certs-' + name)}", f"--token-auth-file={self.work / 'tokens.csv'}",
            "--authorization-mode=RBAC", f"--service-account-key-file={self.work / 'sa.pub'}",
            f"--service-account-signing-key-file={self.work / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true", "--profiling=false",
            "--enable-priority-and-fairness=false", "--endpoint-reconciler-type=none", "--v=1", *extra,
        ]  # fmt: skip
        self.procs[name] = self.ns.popen(argv, self.work / f"{name}.log")
        api = self.api if port == 6443 and hasattr(self, "api") else self.client(port)
        deadline = time.monotonic() + 120
        while not api.ready():
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{(self.work / f'{name}.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready in 120 s:\n{(self.work / f'{name}.log').read_text()[-3000:]}")
            time.sleep(0.2)
        return api

    def stop(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(30)

    def ca(self, name: str = "apiserver") -> Path:
        return self.work / f"certs-{name}" / "apiserver.crt"

    def close(self) -> None:
        for api in self.apis:
            api.close()
        for name in [n for n in self.procs if n != "etcd"] + ["etcd"]:
            self.stop(name)


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

    def write_config(self, mode: str = "auto", extra: str = "") -> None:
        self.mode = mode
        self.config.write_text(
            "http:\n  address: 127.0.0.1:9450\nshutdown_grace_seconds: 2\nlog_level: debug\n"
            "deviceplugin:\n  enabled: false\ncsi:\n  enabled: false\n"
            f"cni:\n  workers: 4\n  cluster:\n    mode: {mode}\n    resync_seconds: 30\n"
            "    cluster_cidrs: [10.244.0.0/16, fd44::/48]\n" + extra
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
        def go() -> tuple[int, str]:
            conn = http.client.HTTPConnection("127.0.0.1", 9450, timeout=5)
            try:
                conn.request("GET", path)
                r = conn.getresponse()
                return r.status, r.read().decode()
            finally:
                conn.close()

        try:
            return self.ns.call(go)  # type: ignore[no-any-return]
        except OSError as e:
            return 0, str(e)

    def wait_ready(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-4000:]
            status, body = self.http("/readyz")
            if status == 200 and "cni: ready" in body:
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready in {timeout}s: {status} {body}\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""

    def netconf(self) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0", "name": "lab", "type": "nodeplug", "bridge": "nodeplug0", "isGateway": True,
            "isDefaultGateway": True, "ipMasq": False, "socket": str(self.root / "run/nodeplug/cni.sock"),
            "ipam": {"type": "nodeplug", "nodeSubnets": str(self.subnets_file),
                     "dataDir": str(self.root / "var/lib/nodeplug/ipam")},
        }  # fmt: skip

    def cni(self, command: str, pod: str, cid: str) -> tuple[int, Any]:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": cid, "CNI_NETNS": f"/run/netns/{pod}", "CNI_IFNAME": "eth0",
               "CNI_PATH": "/usr/lib/cni"}  # fmt: skip
        p = subprocess.run(
            ["ip", "netns", "exec", self.ns.name, "env", *(f"{k}={v}" for k, v in env.items()), ENTRY],
            input=json.dumps(self.netconf()), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None


class Pod:
    def __init__(self, node: Node, ns: Netns, cid: str, result: Any) -> None:
        self.node, self.ns, self.cid = node, ns, cid
        ips = [ipaddress.ip_interface(ip["address"]).ip for ip in result["ips"]]
        self.ip4 = str(next(a for a in ips if a.version == 4))
        self.ip6 = str(next(a for a in ips if a.version == 6))
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

        self.cp = ControlPlane(cp_ns, self.work / "cp", binaries())
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

    def register(self, node: Node, with_cidr: bool = True) -> None:
        """The Node object (podCIDRs unless ``with_cidr`` is False, InternalIPs) and the agent's kubeconfig with a
        service-account token bound to that Node."""
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

    def add_pod(self, node: Node) -> Pod:
        ns = self._ns(f"pod{len(self.pods)}")
        cid = f"{self.tag}-{len(self.pods)}"
        code, result = node.cni("ADD", ns.name, cid)
        if code != 0:
            raise AssertionError(f"ADD on {node.name}: {result}\n{node.log_tail()}")
        pod = Pod(node, ns, cid, result)
        self.pods.append(pod)
        return pod

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
    """The Namespace, and the cluster network's RBAC and admission policy from daemonset/ (the real manifests)."""
    yield from (d for d in yaml.safe_load_all((REPO / "daemonset/namespace.yaml").read_text()) if d)
    for doc in yaml.safe_load_all((REPO / "daemonset/rbac.yaml").read_text()):
        if doc and doc["metadata"]["name"].startswith("nodeplug-network"):
            yield doc


def wait_for(what: str, check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)
