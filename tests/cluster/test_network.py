"""Pod networking on the node: pods get addresses from the nodeplug network and reach each other, and the API
server through the ``kubernetes`` Service."""

from __future__ import annotations

import ipaddress
import json
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .conftest import Cluster  # the fixture's type

# Pods take their addresses from the node's spec.podCIDRs once the agent follows Node objects (the cluster pod
# network); until then from the subnet install-cni wrote into the conflist. Set this when that lands.
ADDRESSES_FROM_POD_CIDR = False


def conflist_subnets(cluster: Cluster) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    conf = json.loads((cluster.cni_conf_dir / "10-nodeplug.conflist").read_text())
    ranges = conf["plugins"][0]["ipam"]["ranges"]
    return [ipaddress.ip_network(r["subnet"]) for rs in ranges for r in rs]


def pod_ips(cluster: Cluster, ns: str, *pods: str) -> dict[str, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    return {p: ipaddress.ip_address(cluster.get("-n", ns, "pod", p)["status"]["podIP"]) for p in pods}


def test_pods_get_addresses_and_reach_each_other(cluster: Cluster, ns: str) -> None:
    cluster.apply(ns, cluster.pod("a"), cluster.pod("b"))
    cluster.wait_running(ns, "a", "b")
    ips = pod_ips(cluster, ns, "a", "b")
    assert ips["a"] != ips["b"]
    subnets = conflist_subnets(cluster)
    for name, ip in ips.items():
        assert any(ip in s for s in subnets), f"pod {name} got {ip}, outside {subnets}"
        # The address kubelet reports is the one the pod has on its interface.
        assert f"inet {ip}/" in cluster.exec(ns, name, "ip", "-o", "addr", "show", "eth0")
    assert " 0% packet loss" in cluster.exec(ns, "a", "ping", "-c", "2", "-W", "2", str(ips["b"]))
    assert " 0% packet loss" in cluster.exec(ns, "b", "ping", "-c", "2", "-W", "2", str(ips["a"]))
    # The API server through the kubernetes Service's ClusterIP (what in-cluster clients use).
    host, port = cluster.exec(ns, "a", "sh", "-c", "echo $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT").split()
    # Go's TLS server answers plain HTTP with a plain 400: the API server, not anything else, is there.
    reply = cluster.exec(ns, "a", "sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}")
    assert "Client sent an HTTP request to an HTTPS server" in reply, reply


@pytest.mark.skipif(not ADDRESSES_FROM_POD_CIDR, reason="the nodeplug network does not follow Node podCIDRs yet")
def test_pod_addresses_come_from_the_nodes_pod_cidr(cluster: Cluster, ns: str) -> None:
    cidrs = [ipaddress.ip_network(c) for c in cluster.get("node", cluster.node)["spec"]["podCIDRs"]]
    cluster.apply(ns, cluster.pod("a"))
    cluster.wait_running(ns, "a")
    ip = pod_ips(cluster, ns, "a")["a"]
    assert any(ip in c for c in cidrs), f"pod address {ip} is outside the node's podCIDRs {cidrs}"
