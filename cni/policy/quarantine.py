"""The quarantine: addresses of this node's pods that no traffic may reach or leave through the node, until the
policy agent has their rules in place. The contract between the CNI side and policy enforcement.

One nftables table of its own, made by the policy agent when it starts and never replaced whole::

    table inet nodeplug-quarantine {
        set q4 { type ipv4_addr; }
        set q6 { type ipv6_addr; }
        chain forward { type filter hook forward priority -2; policy accept;
            ip saddr @q4 drop   ip daddr @q4 drop   ip6 saddr @q6 drop   ip6 daddr @q6 drop }
    }

The CNI side puts an address here (:func:`hold`) whenever it cannot be sure the policy agent knows the pod behind
it: an ADD the agent did not take (the standalone entry point, or the agent not yet in step with the API server),
and every DEL and GC (a freed address must not keep the permissions of the pod that had it, whoever gets it next).
Only the policy agent lets an address go, in the same transaction that installs the rules of the pod that now has
it. Without the table (policy enforcement not in use on this node) :func:`hold` does nothing.

Standard library only: the standalone entry point calls it. :func:`hold` talks to the kernel itself (one nfnetlink
batch, :mod:`cni.policy.nfsets`), so a standalone ADD or DEL runs no ``nft``: it fails closed all the same, as any
refusal but "no such table" (this node enforces no policy) fails the command. :func:`held`, which the redirect
reads at every sync, is one nfnetlink dump per set. The policy agent's side (making the table, releasing addresses)
runs ``nft``.
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Iterable

from cni.dataplane.tools import ToolError, nft_if_there, run_tool
from cni.policy import nfsets

TABLE = "nodeplug-quarantine"
NFT_TIMEOUT = 10.0
SETUP = (
    f"add table inet {TABLE}\n"
    f"add set inet {TABLE} q4 {{ type ipv4_addr; }}\n"
    f"add set inet {TABLE} q6 {{ type ipv6_addr; }}\n"
    f"add chain inet {TABLE} forward {{ type filter hook forward priority -2; policy accept; }}\n"
    f"flush chain inet {TABLE} forward\n"
    + "".join(f"add rule inet {TABLE} forward {fam} {d} @q{v} drop\n"
              for fam, v in (("ip", 4), ("ip6", 6)) for d in ("saddr", "daddr"))
)  # fmt: skip


class QuarantineError(Exception):
    pass


def _by_family(ips: Iterable[str]) -> dict[int, list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """``ips`` (addresses, with or without a prefix) by IP version."""
    out: dict[int, list[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {4: [], 6: []}
    for text in ips:
        a = ipaddress.ip_address(text.split("/")[0])
        out[a.version].append(a)
    return out


def script(verb: str, ips: Iterable[str]) -> str:
    """``add`` or ``delete`` element lines for ``ips`` (for a transaction of the caller's)."""
    return "".join(f"{verb} element inet {TABLE} q{v} {{ {', '.join(sorted(set(map(str, a))))} }}\n"
                   for v, a in _by_family(ips).items() if a)  # fmt: skip


_ABSENT = frozenset({errno.ENOENT, errno.EOPNOTSUPP, errno.EPROTONOSUPPORT})  # no table, or no nf_tables at all


def hold(ips: Iterable[str]) -> bool:
    """Quarantine ``ips`` (in one transaction); False when this node has no quarantine (no policy enforcement).
    :class:`QuarantineError` for any other refusal, or no answer in time: the caller's command fails (closed)."""
    by_family = _by_family(ips)
    if not any(by_family.values()):
        return True
    sets = {f"q{v}": [a.packed for a in addresses] for v, addresses in by_family.items()}
    try:
        nfsets.add_elements(TABLE, sets, timeout=NFT_TIMEOUT)
    except nfsets.NfError as e:
        if e.code in _ABSENT:
            return False
        raise QuarantineError(f"quarantine {', '.join(str(a) for v in by_family.values() for a in v)}: {e}") from None
    return True


def setup() -> None:
    try:
        run_tool(["nft", "-f", "-"], timeout=NFT_TIMEOUT, input=SETUP.encode())
    except ToolError as e:
        raise QuarantineError(f"quarantine table: {e}") from None


def held() -> set[str]:
    """The addresses held now (empty without the table), read over nfnetlink (:func:`cni.policy.nfsets.elements`)."""
    out: set[str] = set()
    for v, size in ((4, 4), (6, 16)):
        try:
            keys = nfsets.elements(TABLE, f"q{v}", timeout=NFT_TIMEOUT)
        except nfsets.NfError as e:
            if e.code in _ABSENT:
                continue
            raise QuarantineError(f"quarantine: {e}") from None
        out.update(str(ipaddress.ip_address(key)) for key in keys if len(key) == size)
    return out


def remove() -> bool:
    """Delete the table; False when it was not there."""
    try:
        return nft_if_there(["delete", "table", "inet", TABLE], NFT_TIMEOUT) is not None
    except ToolError as e:
        raise QuarantineError(f"quarantine: {e}") from None
