"""The local cluster of the cluster tier as its tests use it (``scripts/cluster-up DIR``'s state): kubectl with its
kubeconfig, waiting on objects, busybox pods. The tier's fixtures (tests/cluster/conftest.py) make one."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.host import REPO

BUSYBOX = "localhost/nodeplug-test/busybox:1"


class Cluster:
    """The running cluster: kubectl with its kubeconfig, and waiting on objects."""

    def __init__(self, cluster_dir: Path, kubeconfig: Path) -> None:
        self.dir = cluster_dir
        self.kubeconfig = kubeconfig
        state = json.loads((cluster_dir / "state.json").read_text())
        self.kubectl_bin = state["kubectl"]
        self.node = state["node"]  # the first node: its paths are the machine's own (scripts/cluster/nodes.py)
        self.nodes: list[str] = state.get("nodes", [self.node])
        self.cni_conf_dir = Path(state["cni_conf_dir"])
        self.netns = state["netns"]
        self.namespaces: dict[str, dict[str, str]] = state.get("namespaces", {})
        self.crictl = state["crictl"]
        self.containerd_socket = state["containerd_socket"]
        self.overlay = Path(state["overlay"])  # tests/cluster/overlay with the node's agent config

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True) -> str:
        argv = [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args]
        p = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
        return p.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, ns: str, *objects: dict[str, Any]) -> None:
        self.kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump_all(objects))

    def wait(self, what: str, probe: Callable[[], bool], timeout: float = 120, explain: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if probe():
                return
            time.sleep(0.5)
        raise AssertionError(f"{what}: not within {timeout:.0f} s {explain}")

    def volume_snapshot(self, ns: str, name: str, pvc: str) -> dict[str, Any]:
        """A VolumeSnapshot ``name`` of claim ``pvc`` (class nodeplug-snapshot) made and waited readyToUse; the
        object."""
        spec = {"volumeSnapshotClassName": "nodeplug-snapshot", "source": {"persistentVolumeClaimName": pvc}}
        self.apply(ns, {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
                        "metadata": {"name": name}, "spec": spec})  # fmt: skip
        self.wait("VolumeSnapshot readyToUse", lambda: self.get("-n", ns, "volumesnapshot", name)
                  .get("status", {}).get("readyToUse") is True, 120)  # fmt: skip
        return self.get("-n", ns, "volumesnapshot", name)

    def wait_running(self, ns: str, *pods: str, timeout: float = 120) -> None:
        for pod in pods:
            try:
                self.kubectl("-n", ns, "wait", "--for=condition=Ready", f"pod/{pod}", f"--timeout={timeout:.0f}s",
                             timeout=timeout + 30)  # fmt: skip
            except AssertionError as e:
                events = self.kubectl("-n", ns, "get", "events", "--sort-by=.lastTimestamp", check=False)
                raise AssertionError(f"{e}\nevents in {ns}:\n{events}") from None

    def exec(self, ns: str, pod: str, *cmd: str, timeout: float = 60) -> str:
        return self.kubectl("-n", ns, "exec", pod, "--", *cmd, timeout=timeout)

    def on_node(self, node: str, *argv: str, timeout: float = 60) -> str:
        """``argv`` run as a command on ``node``'s host: in its network namespace and, for nodes after the first,
        its mount and UTS namespaces (scripts/cluster/nodes.py); its output."""
        where = self.namespaces[node]
        own = [f"--mount={where['mnt']}", f"--uts={where['uts']}"] if where["mnt"] else []
        enter = ["nsenter", f"--net={where['net']}", *own, "--"]
        p = subprocess.run([*enter, *argv], capture_output=True, text=True, timeout=timeout, check=False)
        if p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} on {node} failed ({p.returncode}): {p.stderr.strip()}")
        return p.stdout

    def cluster_routes(self, node: str) -> dict[str, dict[str, Any]]:
        """The routes the agent keeps on ``node`` (its route protocol, ``cni.cluster.route_protocol``'s default 110),
        by destination (both families), as ``ip -j route`` gives them."""
        routes = {}
        for version in ("-4", "-6"):
            out = self.on_node(node, "ip", version, "-j", "route", "show", "proto", "110")
            routes.update({r["dst"]: r for r in json.loads(out or "[]")})
        return routes

    def agent_pod(self, node: str = "") -> str:
        """The running agent pod of ``node`` (default: the first node)."""
        pods = self.get("-n", "nodeplug-system", "pods", "-l", "app.kubernetes.io/name=nodeplug")["items"]
        running = [p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"
                   and not p["metadata"].get("deletionTimestamp")
                   and p["spec"].get("nodeName") == (node or self.node)]  # fmt: skip
        assert len(running) == 1, f"expected one running agent pod, got {[p['metadata']['name'] for p in pods]}"
        return running[0]

    def restart(self, daemon: str) -> None:
        """Restart one of the node's daemons (``kubelet``, ``containerd``) with ``scripts/cluster-restart``."""
        p = subprocess.run([str(REPO / "scripts" / "cluster-restart"), str(self.dir), daemon], capture_output=True,
                           text=True, timeout=120, check=False)  # fmt: skip
        if p.returncode != 0:
            raise AssertionError(f"scripts/cluster-restart {daemon} failed ({p.returncode}): {p.stderr.strip()}")

    def metrics(self) -> str:
        """The agent's /metrics, through the API server's proxy to its pod (as a scraper in the cluster reads it)."""
        return self.agent_http("/metrics")

    def sample(self, name: str, **labels: str) -> float:
        """One sample of the first node's agent's metrics (0 when absent)."""
        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return 0.0

    def agent_http(self, path: str) -> str:
        """``path`` of the first node's agent's HTTP server (``/metrics``, ``/readyz``), through the API server's proxy
        to its pod."""
        return self.kubectl(
            "get", "--raw", f"/api/v1/namespaces/nodeplug-system/pods/{self.agent_pod()}:9450/proxy{path}"
        )

    @contextlib.contextmanager
    def agent_config(self, edit: Callable[[dict[str, Any]], None]) -> Iterator[None]:
        """The agent's config (its ConfigMap's ``agent.yaml``) changed by ``edit`` and the DaemonSet rolled onto it,
        as an operator changes it; the config before put back and rolled out again afterwards."""
        ds = self.get("-n", "nodeplug-system", "daemonset", "nodeplug")
        (name,) = [v["configMap"]["name"] for v in ds["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
        cm = self.get("-n", "nodeplug-system", "configmap", name)
        original = cm["data"]["agent.yaml"]
        cfg = yaml.safe_load(original)
        edit(cfg)

        def put(text: str) -> None:
            obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "nodeplug-system"},
                   "data": {**cm["data"], "agent.yaml": text}}  # fmt: skip
            self.kubectl("replace", "-f", "-", input=json.dumps(obj))
            self.kubectl("-n", "nodeplug-system", "rollout", "restart", "daemonset/nodeplug")
            self.rollout()

        put(yaml.safe_dump(cfg, sort_keys=False))
        try:
            yield
        finally:
            put(original)

    def rollout(self) -> None:
        bound = 180 + 120 * (len(self.nodes) - 1)  # the DaemonSet replaces its pods node by node
        self.kubectl("-n", "nodeplug-system", "rollout", "status", "daemonset/nodeplug", f"--timeout={bound}s",
                     timeout=bound + 20)  # fmt: skip

    def pod(self, name: str, *command: str, **spec: Any) -> dict[str, Any]:
        """A busybox pod running ``command`` (default: sleep until deleted) on the first node (whose paths the tests
        read; ``nodeSelector`` in ``spec`` places it elsewhere); ``resources``, ``volumeMounts`` and
        ``securityContext`` go to its container, the rest of ``spec`` to the pod."""
        container: dict[str, Any] = {
            "name": "app",
            "image": BUSYBOX,
            "imagePullPolicy": "Never",
            "command": list(command) or ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
        }
        for key in ("resources", "volumeMounts", "securityContext"):
            if key in spec:
                container[key] = spec.pop(key)
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "containers": [container],
                "terminationGracePeriodSeconds": 2,
                "nodeSelector": {"kubernetes.io/hostname": self.node},
                **spec,
            },
        }
