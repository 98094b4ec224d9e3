"""Remove the cluster network from this node: exactly what the agent owns, and nothing else.

- every route in the main table carrying the agent's route protocol (``cni.cluster.route_protocol``, 110 unless
  configured otherwise), IPv4 and IPv6;
- the VXLAN device ``nodeplug.vx`` (its FDB and neighbour entries go with it); a link of that name that is not a
  VXLAN device is left alone and reported;
- the masquerade table ``inet nodeplug-cluster``;
- the subnets file the CNI entry point reads (only when it is one: it parses as such), and its directory when that
  is the agent's ``cluster`` directory and left empty.

Run by the agent when an uninstall asks it to (:mod:`cni.cluster.uninstall`) and by ``nodeplug install-cni
--uninstall`` itself, in the node's network namespace, over a netlink socket of the calling thread. Idempotent:
what is already gone is not an error. Forwarding sysctls stay as they are (other software on the node may rely on
them), and so do the Node's ``nodeplug.io/vtep-*`` annotations (the API, not the node).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from cni.cluster import kernel, masq
from cni.dataplane.messages import RouteMsg
from cni.dataplane.nl import get_link, link_kind
from cni.dataplane.rtnl import RTM_DELROUTE, RTM_GETROUTE, NetlinkError, Rtnl
from cni.nodesubnets import SubnetsError, read
from cni.redirect import manager as redirect


@dataclass
class Removal:
    """What a removal did, what it left alone (not nodeplug's) and what failed; one line each."""

    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def remove(nl: Rtnl, protocol: int, subnets_file: Path | None) -> Removal:
    out = Removal()
    routes = _remove_routes(nl, protocol, out)
    if routes:
        out.removed.append(f"removed {len(routes)} route(s) of protocol {protocol}: {', '.join(routes)}")
    msg = get_link(nl, kernel.VXLAN_DEVICE)
    if msg is not None and link_kind(msg) != "vxlan":
        out.kept.append(f"left {kernel.VXLAN_DEVICE} in place: it is a {link_kind(msg) or 'non-VXLAN'} device")
    elif msg is not None:
        try:
            if kernel.remove_vxlan(nl):
                out.removed.append(f"removed the VXLAN device {kernel.VXLAN_DEVICE} and its FDB and neighbour entries")
        except kernel.KernelError as e:
            out.failed.append(str(e))
    try:
        gone = redirect.detach_all(nl)
        if gone:
            out.removed.append(f"took the redirect program off {len(gone)} device(s): {', '.join(gone)}")
    except OSError as e:
        out.failed.append(f"take the redirect program off: {e}")
    try:
        if masq.remove():
            out.removed.append(f"removed the nftables table inet {masq.TABLE}")
    except masq.MasqError as e:
        out.failed.append(str(e))
    if subnets_file is not None:
        _remove_subnets(subnets_file, out)
    return out


def _remove_routes(nl: Rtnl, protocol: int, out: Removal) -> list[str]:
    done: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            found = nl.dump(RouteMsg(family=family), RTM_GETROUTE, RouteMsg)
        except NetlinkError as e:
            out.failed.append(f"list IPv{4 if family == socket.AF_INET else 6} routes: {e}")
            continue
        for msg in found:
            table = msg.get("RTA_TABLE") or msg["table"]
            if table != kernel.RT_TABLE_MAIN or msg["proto"] != protocol:
                continue
            dst = ipaddress.ip_network(f"{msg.get('RTA_DST') or ('0.0.0.0' if family == socket.AF_INET else '::')}"
                                       f"/{msg['dst_len']}", strict=False)  # fmt: skip
            req = RouteMsg()
            for key in ("family", "dst_len", "table", "proto", "scope", "type"):
                req[key] = msg[key]
            attrs = [("RTA_TABLE", table)]
            if msg.get("RTA_DST"):
                attrs.append(("RTA_DST", msg.get("RTA_DST")))
            if msg.get("RTA_PRIORITY") is not None:
                attrs.append(("RTA_PRIORITY", msg.get("RTA_PRIORITY")))
            req["attrs"] = attrs
            try:
                nl.ack(req, RTM_DELROUTE)
            except NetlinkError as e:
                if e.code not in (errno.ESRCH, errno.ENOENT):
                    out.failed.append(f"delete route to {dst}: {e}")
                continue
            done.append(str(dst))
    return done


def _remove_subnets(path: Path, out: Removal) -> None:
    try:
        found = read(str(path))
    except SubnetsError as e:
        out.kept.append(f"left {path} in place: not a subnets file nodeplug wrote ({e})")
        return
    if found is None:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    out.removed.append(f"removed {path}")
    if path.parent.name == "cluster":  # the agent's own directory (/var/lib/nodeplug/cluster); kept when not empty
        with contextlib.suppress(OSError):
            path.parent.rmdir()
