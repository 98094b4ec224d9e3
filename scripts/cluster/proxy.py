"""kube-proxy on the node: Services (ClusterIPs, NodePorts) for pods and for the node itself, as on any cluster.

It runs beside kubelet, a daemon of the node (in the cluster's network namespace and cgroup, started and restarted
like the others), from KUBE_ASSETS, with the identity RBAC's bootstrap policy gives it (user ``system:kube-proxy``,
bound to ``system:node-proxier``).

Mode: **nftables**. kube-proxy then keeps everything in tables of its own (``ip kube-proxy``, ``ip6 kube-proxy``)
programmed through the ``nft`` binary (Debian's nftables, which scripts/setup installs), beside nodeplug's own nftables
tables (pod masquerading, network policy) in the same framework, with explicit hook priorities between them and no
iptables compatibility layer or xtables lock in between. Debian's iptables is the nft-backed one, so iptables mode
would also land in nftables, but as translated xtables rules sharing the ``ip filter``/``ip nat`` tables with anyone
else who uses iptables. nftables mode is beta and on by default in Kubernetes 1.31+ and needs kernel 5.13+; this
machine's is newer.

Bridged traffic: a pod reaching a ClusterIP whose endpoint sits on the same pod bridge gets its reply straight over
the bridge; only bridge netfilter (``net.bridge.bridge-nf-call-iptables``, per network namespace) sends those frames
through the IP hooks where conntrack undoes the DNAT. cluster-up sets it in the node's namespace, as kubeadm's
preflight demands of any node.

The conntrack settings are left as the kernel has them (``maxPerCore: 0`` and zero timeouts mean "do not touch"):
they are machine-wide sysctls, and the node shares the machine's kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster import node as daemons
from cluster.common import CLUSTER_CIDR, CLUSTER_CIDR6, ClusterError, State, run, wait_for
from cluster.nodes import Node
from cluster.pki import Pki

HEALTHZ = "127.0.0.1:10256"
METRICS = "127.0.0.1:10249"


def config(state: State, pki: Pki, node: Node) -> Path:
    cfg = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(pki.kubeconfig("kube-proxy"))},
        "mode": "nftables",
        "hostnameOverride": node.name,
        "clusterCIDR": f"{CLUSTER_CIDR},{CLUSTER_CIDR6}",  # traffic from outside it to a ClusterIP is masqueraded
        "healthzBindAddress": HEALTHZ,
        "metricsBindAddress": METRICS,
        # This machine's root lacks CAP_SYS_RESOURCE: kube-proxy may not lower its oom_score_adj (default -999).
        "oomScoreAdj": 0,
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s",
                      "udpTimeout": "0s", "udpStreamTimeout": "0s"},
    }  # fmt: skip
    path = state.dir / f"{node.suffix('kube-proxy')}.json"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def bridge_netfilter(node: Node) -> None:
    """Bridged frames through the IP hooks in the node's namespace (see the module's docstring)."""
    for family in ("iptables", "ip6tables"):
        run(node.enter(["sysctl", "-q", "-w", f"net.bridge.bridge-nf-call-{family}=1"]))


def wait_serving(state: State, kubectl: list[str], node: Node) -> None:
    """Until the ``kubernetes`` Service answers at its ClusterIP from ``node`` (what the agent's in-cluster client
    dials first): that node's kube-proxy has synced its rules."""
    svc = json.loads(run([*kubectl, "-n", "default", "get", "service", "kubernetes", "-o", "json"]))
    ip = svc["spec"]["clusterIP"]
    port = next(p for p in svc["spec"]["ports"] if p["name"] == "https")["port"]

    def answers() -> bool:
        # Anonymous /readyz is allowed by RBAC's bootstrap policy: "ok" comes from the API server itself.
        out = run(node.enter(["curl", "-sk", "--max-time", "2", f"https://{ip}:{port}/readyz"]), check=False)
        return out.strip() == "ok"

    wait_for(f"the kubernetes Service at {ip}:{port} through kube-proxy on {node.name}", answers, 60,
             state.dir / "logs" / f"{node.suffix('kube-proxy')}.log")  # fmt: skip


def start(state: State, bins: dict[str, Path], pki: Pki, node: Node) -> None:
    bridge_netfilter(node)
    argv: list[str | Path] = [bins["kube-proxy"], f"--config={config(state, pki, node)}", "--v=2"]
    daemons.start(state, node.suffix("kube-proxy"), argv, node=node)


def check_mode(node: Node) -> None:
    """kube-proxy runs the mode asked: its table is there (it would fall back to another mode with a log line)."""
    if run(node.enter(["nft", "list", "table", "ip", "kube-proxy"]), check=False).strip() == "":
        raise ClusterError("kube-proxy: no nftables table `ip kube-proxy` in the node's namespace (another mode?)")
