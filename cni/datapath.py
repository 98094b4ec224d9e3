"""What a pod sees of each datapath, as pure values (the kernel work is :mod:`cni.dataplane`).

``bridge`` (the reference bridge plugin's shape): the pod's address carries its subnet's prefix, its default route
goes via the subnet's gateway address, which sits on the node's bridge.

``routed`` (no bridge; as Calico attaches pods): the pod's address is a host address (/32, /128) and its routes go
via a link-local gateway that is the same for every pod: 169.254.1.1 for IPv4, fe80::1 for IPv6. Nothing on the node
carries these addresses: ADD puts a permanent neighbour entry for each into the pod, mapping it to the MAC of the
pod's own host-side veth, so the pod sends everything to the node without asking (no ARP or neighbour
solicitation, no proxy ARP, no per-pod gateway address), and the node routes it. Proxy ARP (Calico's way for IPv4)
answers only while the node has a route to 169.254.1.1 through another interface, which a node without a default
route lacks; the neighbour entry works whatever the node's routing table. The node's own address as the gateway
would tie every pod's routes to an address that changes with the node's interfaces.

Standard library only: the orchestration (:mod:`cni.commands`) fills in results from this on every ADD.
"""

from __future__ import annotations

import ipaddress

from cni.types import IPAddress, IPConfig

GATEWAY: dict[int, IPAddress] = {4: ipaddress.IPv4Address("169.254.1.1"), 6: ipaddress.IPv6Address("fe80::1")}


def host_address(ip: IPConfig) -> IPConfig:
    """``ip`` as the routed datapath puts it on the pod: the address alone (/32, /128)."""
    return ip._replace(address=ipaddress.ip_interface(f"{ip.address.ip}/{ip.address.max_prefixlen}"))


def with_routed_gateway(ip: IPConfig) -> IPConfig:
    """``ip`` with its family's link-local gateway in place of the subnet's (routes resolve through it)."""
    return ip._replace(gateway=GATEWAY[ip.version])
