"""A real etcd + kube-apiserver in a network namespace of their own, and a small REST client that speaks to them from
inside it: the control plane of the cluster-network lab (:mod:`lab.clusterlab`) and of the DRA bench
(:mod:`lab.dralab`).

The apiserver listens on :data:`CP_ADDR`:6443 with RBAC on; the admin authenticates with a static token
(:data:`ADMIN_TOKEN`), service accounts with keys made by openssl. The binaries come from ``KUBE_ASSETS`` through
the one cache of :mod:`lab.kubeassets`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

from lab import kubeassets
from lab.host import sh
from lab.netns import Netns

ADMIN_TOKEN = "nodeplug-lab-admin-" + "0" * 8
CP_ADDR = "192.168.77.250"


def missing_assets() -> str:
    """Why a control plane cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root: creates network namespaces"
    if reason := kubeassets.absent("etcd", "kube-apiserver"):
        return reason
    for tool in ("openssl", "nft", "ping"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return ""


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
    """etcd and kube-apiserver(s) in ``ns``, their state and logs in ``work``; :meth:`close` stops them all."""

    def __init__(self, ns: Netns, work: Path) -> None:
        self.ns, self.work = ns, work
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
            [str(kubeassets.binary("etcd")), "--name", "lab", "--data-dir", str(data),
             "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
             "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "lab=http://127.0.0.1:2380", "--listen-metrics-urls", "http://127.0.0.1:2381",
             "--quota-backend-bytes", str(1 << 30)],
            self.work / "etcd.log",
        )  # fmt: skip

    def start_apiserver(self, name: str = "apiserver", port: int = 6443, extra: tuple[str, ...] = ()) -> Api:
        argv = [
            str(kubeassets.binary("kube-apiserver")), "--etcd-servers=http://127.0.0.1:2379",
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
