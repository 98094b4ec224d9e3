"""Masquerading for the cluster network: pod traffic leaving the cluster CIDRs gets the node's address.

One nftables table of its own, replaced whole in one transaction whenever its content changes (this node's
podCIDRs, or the cluster CIDRs: configured, or else every Node's podCIDRs the plan does not refuse)::

    table inet nodeplug-cluster {
        set cluster4 { type ipv4_addr; flags interval; auto-merge; elements = { 10.244.0.0/16 } }
        set cluster6 { type ipv6_addr; flags interval; auto-merge; elements = { fd44::/48 } }
        chain postrouting {
            type nat hook postrouting priority srcnat; policy accept;
            ip saddr 10.244.1.0/24 ip daddr != @cluster4 ip daddr != 224.0.0.0/4 masquerade
            ip6 saddr fd44:0:0:1::/64 ip6 daddr != @cluster6 ip6 daddr != ff00::/8 masquerade
        }
    }

Pod to pod across nodes therefore keeps its source address (the network model), and only traffic to the rest of
the world is translated. The CNI conflist of the cluster network sets ``ipMasq: false``: the per-pod rules of
:mod:`cni.dataplane.masq` would translate pod-to-pod traffic as well.
"""

from __future__ import annotations

from collections.abc import Iterable

from cni.cluster.model import IPNetwork
from cni.dataplane.tools import ToolError, nft_if_there, run_tool

TABLE = "nodeplug-cluster"
NFT_TIMEOUT = 10.0
_MULTICAST = {4: "224.0.0.0/4", 6: "ff00::/8"}


class MasqError(Exception):
    pass


def script(pod_cidrs: Iterable[IPNetwork], cluster: Iterable[IPNetwork]) -> str:
    """The nft script that (re)creates the table: one rule per pod CIDR of this node."""
    cluster = list(cluster)
    lines = [f"table inet {TABLE} {{}}\n", f"delete table inet {TABLE}\n", f"table inet {TABLE} {{\n"]
    for v in (4, 6):
        elements = ", ".join(str(n) for n in cluster if n.version == v)
        body = f" elements = {{ {elements} }};" if elements else ""
        lines.append(f"  set cluster{v} {{ type ipv{v}_addr; flags interval; auto-merge;{body} }}\n")
    lines.append("  chain postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n")
    for c in pod_cidrs:
        fam, mcast = ("ip" if c.version == 4 else "ip6"), _MULTICAST[c.version]
        lines.append(f"    {fam} saddr {c} {fam} daddr != @cluster{c.version} {fam} daddr != {mcast} masquerade\n")
    lines.append("  }\n}\n")
    return "".join(lines)


def install(pod_cidrs: Iterable[IPNetwork], cluster: Iterable[IPNetwork]) -> None:
    try:
        run_tool(["nft", "-f", "-"], timeout=NFT_TIMEOUT, input=script(pod_cidrs, cluster).encode())
    except ToolError as e:
        raise MasqError(f"masquerade: {e}") from None


def remove() -> bool:
    """Delete the table; False when it was not there."""
    try:
        return nft_if_there(["delete", "table", "inet", TABLE], NFT_TIMEOUT) is not None
    except ToolError as e:
        raise MasqError(f"masquerade: {e}") from None
