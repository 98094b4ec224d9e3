"""ipMasq through nftables: one table owned by nodeplug, one rule per pod address, found again by its comment.

::

    table inet nodeplug {
        chain postrouting {
            type nat hook postrouting priority srcnat; policy accept;
            ip saddr 10.22.0.5 ip daddr != 10.22.0.0/16 ip daddr != 224.0.0.0/4 masquerade comment "nodeplug veth.."
            ip6 saddr fd00::5 ip6 daddr != fd00::/64 ip6 daddr != ff00::/8 masquerade comment "nodeplug veth.."
        }
    }

Like the reference plugin, traffic from the pod to its own subnet and to multicast is left alone and everything else
is masqueraded. The comment starts with the attachment's host veth name and the network (:mod:`cni.dataplane.names`)
so DEL and GC find the rules without knowing the addresses. ADD is one ``nft -f -`` transaction adding the rules; only
when that fails because the table is missing is it run again with the table and chain declared (declaring them on
every ADD re-registers the hook and triples the cost of the transaction; the declarations are idempotent, so concurrent
first ADDs do not race). Plain negated prefixes rather than an anonymous set keep the transaction cheap too. DEL and
GC list the chain as JSON and delete by handle in one more transaction. ``nft`` runs from the calling thread, so it
works in that thread's netns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from cni.dataplane import names
from cni.dataplane.tools import ToolError, nft_if_there, run_tool
from cni.errors import DATAPLANE, CniError

TABLE = "nodeplug"
CHAIN = "postrouting"
NFT_TIMEOUT = 10.0
_MULTICAST = {4: "224.0.0.0/4", 6: "ff00::/8"}
_SKELETON = (
    f"table inet {TABLE} {{\n  chain {CHAIN} {{ type nat hook postrouting priority srcnat; policy accept; }}\n}}\n"
)


def _nft(args: Sequence[str], script: str | None = None) -> str:
    argv = ["nft", *args] if script is None else ["nft", *args, "-f", "-"]
    return run_tool(argv, timeout=NFT_TIMEOUT, input=script.encode() if script is not None else None)


def rules_script(comment: str, addresses: Sequence[Any], declare: bool = False) -> str:
    """The nft script adding one rule per address (``ipaddress.IPv4Interface`` / ``IPv6Interface``); with
    ``declare``, the table and chain are declared first."""
    lines = [_SKELETON] if declare else []
    for a in addresses:
        fam = "ip" if a.version == 4 else "ip6"
        lines.append(
            f"add rule inet {TABLE} {CHAIN} {fam} saddr {a.ip} {fam} daddr != {a.network} "
            f'{fam} daddr != {_MULTICAST[a.version]} masquerade comment "{comment}"\n'
        )
    return "".join(lines)


def add_rules(network: str, host_veth: str, container_id: str, addresses: Sequence[Any]) -> None:
    """Masquerade traffic from ``addresses`` leaving their subnets (one atomic nft transaction)."""
    if not addresses:
        return
    comment = names.rule_comment(network, host_veth, container_id)
    try:
        _nft([], rules_script(comment, addresses))
        return
    except ToolError as e:
        if "No such file or directory" not in e.stderr:
            raise e.cni_error("ipMasq") from None
    try:
        _nft([], rules_script(comment, addresses, declare=True))
    except ToolError as e:
        raise e.cni_error("ipMasq") from None


def _rules() -> list[dict[str, Any]]:
    """The rules of our chain as nft's JSON gives them; empty when the table (or nft itself) is absent."""
    try:
        out = nft_if_there(["-j", "list", "chain", "inet", TABLE, CHAIN], NFT_TIMEOUT)
    except ToolError as e:
        raise e.cni_error("ipMasq") from None
    if out is None:
        return []  # no table, or no nft: no rule of ours can exist
    try:
        items = json.loads(out).get("nftables", [])
    except (ValueError, AttributeError):
        raise CniError(DATAPLANE, details=f"ipMasq: nft -j printed something unexpected: {out[:200]!r}") from None
    rules = (item.get("rule") if isinstance(item, dict) else None for item in items)
    return [rule for rule in rules if isinstance(rule, dict) and "handle" in rule]


def list_rules() -> list[tuple[int, str]]:
    """``(handle, comment)`` of every rule in our chain; empty when the table (or nft itself) is absent."""
    return [(int(rule["handle"]), str(rule.get("comment", ""))) for rule in _rules()]


def sources(network: str, host_veth: str) -> set[str]:
    """The source addresses the attachment's masquerade rules match (CHECK compares them with prevResult)."""
    key = names.rule_key(network, host_veth)
    out: set[str] = set()
    for rule in _rules():
        comment = str(rule.get("comment", ""))
        if comment != key and not comment.startswith(key + " "):
            continue
        for expr in rule.get("expr") or ():
            match = expr.get("match") if isinstance(expr, dict) else None
            if not isinstance(match, dict) or match.get("op") != "==" or not isinstance(match.get("left"), dict):
                continue
            payload = match["left"].get("payload")
            if isinstance(payload, dict) and payload.get("field") == "saddr":
                out.add(str(match.get("right")))
    return out


def delete_rules(select: Callable[[str], bool]) -> int:
    """Delete every rule of our chain whose comment ``select`` picks; the number deleted. A rule deleted by someone
    else in the meantime (a parallel DEL or GC) is not an error: the listing is retried once."""
    for attempt in range(2):
        handles = [h for h, comment in list_rules() if select(comment)]
        if not handles:
            return 0
        script = "".join(f"delete rule inet {TABLE} {CHAIN} handle {h}\n" for h in handles)
        try:
            _nft([], script)
            return len(handles)
        except ToolError as e:
            if attempt == 0 and "No such file or directory" in e.stderr:
                continue
            raise e.cni_error("ipMasq") from None
    return 0


def delete_attachment(network: str, host_veth: str) -> int:
    key = names.rule_key(network, host_veth)
    return delete_rules(lambda comment: comment == key or comment.startswith(key + " "))
