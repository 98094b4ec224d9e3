"""Pod networking on the node: pods get addresses from the node's podCIDRs (the cluster pod network) and reach each
other, and the API server through the ``kubernetes`` Service."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type


def pod_cidrs(cluster: Cluster) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The node's spec.podCIDRs (kube-controller-manager --allocate-node-cidrs): what the agent hands out from."""
    return [ipaddress.ip_network(c) for c in cluster.get("node", cluster.node)["spec"]["podCIDRs"]]


def pod_ips(cluster: Cluster, ns: str, *pods: str) -> dict[str, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    return {p: ipaddress.ip_address(cluster.get("-n", ns, "pod", p)["status"]["podIP"]) for p in pods}


def test_pods_get_addresses_and_reach_each_other(cluster: Cluster, ns: str) -> None:
    cluster.apply(ns, cluster.pod("a"), cluster.pod("b"))
    cluster.wait_running(ns, "a", "b")
    ips = pod_ips(cluster, ns, "a", "b")
    assert ips["a"] != ips["b"]
    cidrs = pod_cidrs(cluster)
    for name, ip in ips.items():
        assert any(ip in c for c in cidrs), f"pod {name} got {ip}, outside the node's podCIDRs {cidrs}"
        # The address kubelet reports is the one the pod has on its interface.
        assert f"inet {ip}/" in cluster.exec(ns, name, "ip", "-o", "addr", "show", "eth0")
    assert " 0% packet loss" in cluster.exec(ns, "a", "ping", "-c", "2", "-W", "2", str(ips["b"]))
    assert " 0% packet loss" in cluster.exec(ns, "b", "ping", "-c", "2", "-W", "2", str(ips["a"]))
    # The API server through the kubernetes Service's ClusterIP (what in-cluster clients use).
    host, port = cluster.exec(ns, "a", "sh", "-c", "echo $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT").split()
    # Go's TLS server answers plain HTTP with a plain 400: the API server, not anything else, is there.
    reply = cluster.exec(ns, "a", "sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}")
    assert "Client sent an HTTP request to an HTTPS server" in reply, reply


def test_an_established_flow_between_pods_goes_past_the_forwarding_path(cluster: Cluster, ns: str) -> None:
    """The shipped config has ``cluster_network.redirect`` on: once a TCP connection between two pods is established,
    its packets are handed from one pod's veth into the other pod, and the agent counts them."""
    serve = "mkdir -p /w && dd if=/dev/zero of=/w/big bs=1M count=32 2>/dev/null && httpd -f -p 8080 -h /w"
    cluster.apply(ns, cluster.pod("srv", "sh", "-c", serve), cluster.pod("cli"))
    cluster.wait_running(ns, "srv", "cli")
    ip = pod_ips(cluster, ns, "srv")["srv"]
    before = cluster.sample("nodeplug_cluster_redirected_packets_total", way="peer")
    url = f"http://{ip}:8080/big"
    fetch = f"for i in 1 2 3 4 5; do wget -q -O - {url} && break; sleep 1; done | wc -c"  # until httpd listens
    got = cluster.exec(ns, "cli", "sh", "-c", fetch)
    assert got.strip() == str(32 << 20)
    assert cluster.sample("nodeplug_cluster_redirected_packets_total", way="peer") - before > 100
