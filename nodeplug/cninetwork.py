"""What the CNI plugin leaves in the node's network namespace once its last pod is gone, removed at uninstall.

The bridge a nodeplug network names (created at the first ADD, kept while pods are attached) and nodeplug's
masquerade table (``table inet nodeplug``, one rule per pod address): DEL of the last pod removes its veth and its
rules but neither of these, since another pod may come. ``nodeplug install-cni --uninstall`` removes them when they are
unused: a bridge only when it is a bridge with no interface attached, the table only when it holds no rule (a
concurrent ADD finding it gone declares it again).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nodeplug import commands

MASQ_TABLE = ("inet", "nodeplug")
TIMEOUT = 10.0


def bridges(conf: Any, default: str) -> list[str]:
    """The bridges the nodeplug plugins of a conflist use."""
    plugins = conf.get("plugins", []) if isinstance(conf, dict) else []
    return [str(p.get("bridge") or default) for p in plugins if isinstance(p, dict) and p.get("type") == "nodeplug"]


def _ip_json(*args: str) -> list[dict[str, Any]]:
    out = commands.run(["ip", "-j", *args], TIMEOUT).strip()
    return list(json.loads(out)) if out else []


def remove_bridge(name: str, say: Callable[[str], None]) -> None:
    try:
        links = _ip_json("-d", "link", "show", "dev", name)
    except commands.CommandError:
        return  # not there
    if not links or links[0].get("linkinfo", {}).get("info_kind") != "bridge":
        say(f"left {name} in place: not a bridge")
        return
    ports = [p["ifname"] for p in _ip_json("link", "show", "master", name)]
    if ports:
        say(f"left bridge {name} in place: pods are still attached ({', '.join(ports)})")
        return
    commands.run(["ip", "link", "delete", name, "type", "bridge"], TIMEOUT)
    say(f"removed bridge {name}")


def remove_masq_table(say: Callable[[str], None]) -> None:
    family, table = MASQ_TABLE
    try:
        listing = json.loads(commands.run(["nft", "-j", "list", "table", family, table], TIMEOUT))
    except commands.CommandError:
        return  # no table (or no nftables on this node)
    rules = [o for o in listing.get("nftables", []) if "rule" in o]
    if rules:
        say(f"left nftables table {family} {table} in place: it still masquerades {len(rules)} pod address(es)")
        return
    commands.run(["nft", "delete", "table", family, table], TIMEOUT)
    say(f"removed nftables table {family} {table}")


def remove_unused(conf: Any, default_bridge: str, say: Callable[[str], None]) -> None:
    """Remove the conflist's bridges and nodeplug's masquerade table if unused; failures are reported, not raised."""
    try:
        for name in bridges(conf, default_bridge):
            remove_bridge(name, say)
        remove_masq_table(say)
    except commands.CommandError as e:
        say(f"left the network in place: {e}")
