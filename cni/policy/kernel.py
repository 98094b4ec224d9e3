"""The kernel side of policy enforcement: the ``inet nodeplug-policy`` table applied through ``nft -f`` (one
transaction per change), its drop counters read back, and the sysctls that send bridged pod traffic through the
inet forward hook.

With the bridge datapath, a packet between two pods on the same bridge is switched, not routed: it reaches the
inet ``forward`` hook only when ``net.bridge.bridge-nf-call-iptables`` (``-ip6tables`` for IPv6) is 1 in the
node's network namespace (``CONFIG_BRIDGE_NETFILTER``), which :func:`bridge_netfilter` ensures. Routed pod traffic
(another node, a routed datapath) takes the forward hook anyway.
"""

from __future__ import annotations

import json

from cni.dataplane import sysctl
from cni.dataplane.tools import ToolError, nft_if_there, run_tool
from cni.errors import CniError
from cni.policy.ruleset import TABLE

NFT_TIMEOUT = 30.0
BRIDGE_SYSCTLS = ("net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables")


class KernelError(Exception):
    pass


def apply(script: str) -> None:
    """Run ``script`` as one ``nft -f`` transaction: all of it or nothing."""
    if not script:
        return
    try:
        run_tool(["nft", "-f", "-"], timeout=NFT_TIMEOUT, input=script.encode())
    except ToolError as e:
        raise KernelError(str(e)) from None


def counters(table: str = TABLE) -> dict[str, int]:
    """Packets counted by each named counter of the table (empty when it is not there)."""
    try:
        text = nft_if_there(["-j", "list", "counters", "table", "inet", table], NFT_TIMEOUT)
    except ToolError as e:
        raise KernelError(str(e)) from None
    if text is None:
        return {}
    out: dict[str, int] = {}
    for item in json.loads(text).get("nftables", []):
        c = item.get("counter") if isinstance(item, dict) else None
        if isinstance(c, dict) and isinstance(c.get("name"), str):
            out[c["name"]] = int(c.get("packets") or 0)
    return out


def exists(table: str = TABLE) -> bool:
    return _on_table("list", table)


def remove(table: str = TABLE) -> bool:
    """Delete the table; False when it was not there."""
    return _on_table("delete", table)


def _on_table(verb: str, table: str) -> bool:
    """``nft <verb> table inet <table>``; False when the table is not there."""
    try:
        return nft_if_there([verb, "table", "inet", table], NFT_TIMEOUT) is not None
    except ToolError as e:
        raise KernelError(str(e)) from None


def bridge_netfilter() -> str:
    """Send bridged IPv4 and IPv6 through the inet hooks in this network namespace; "" or the problem."""
    try:
        for key in BRIDGE_SYSCTLS:
            sysctl.ensure(key, "1")
    except CniError as e:
        return f"{e.details}: traffic between pods on one bridge is not filtered (needs CONFIG_BRIDGE_NETFILTER)"
    return ""
