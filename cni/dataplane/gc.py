"""GC: remove this network's host veths and masquerade rules whose attachment the runtime no longer knows.

Ours are recognised by their marks (:mod:`cni.dataplane.names`): a host veth by its alias naming the network, a rule by
its comment naming the host veth and the network. Every attachment in ``valid`` maps to its host veth name; anything
of this network not among those names goes. Other networks' veths and rules, and links without our alias, are never
touched. Deleting a host veth takes its pod end with it (and its host routes); the network bridge's proxy entries
for routed pods (:mod:`cni.dataplane.routed`) whose address the node no longer routes go too.
"""

from __future__ import annotations

from collections.abc import Collection

from cni.dataplane import masq, names, routed
from cni.dataplane.nl import host_socket, links
from cni.dataplane.veth import delete_host_end
from cni.netconf import BridgeConf


def gc(conf: BridgeConf, valid: Collection[tuple[str, str]]) -> None:
    """Remove stale attachments of ``conf.name``; ``valid`` holds the ``(container_id, ifname)`` pairs to keep."""
    keep = {names.host_veth_name(cid, ifname) for cid, ifname in valid}
    prefix = names.alias_network_prefix(conf.name)
    with host_socket() as nl:
        for msg in links(nl):
            name = msg.get("IFLA_IFNAME")
            alias = msg.get("IFLA_IFALIAS") or ""
            if alias.startswith(prefix) and name not in keep:
                delete_host_end(nl, name)
        routed.forget_stale_on_bridge(nl, conf.bridge)
    key = names.netkey(conf.name)

    def stale(comment: str) -> bool:
        parsed = names.parse_rule_comment(comment)
        return parsed is not None and parsed[1] == key and parsed[0] not in keep

    masq.delete_rules(stale)
