"""Kernel changes that undo the cluster network, seen as they happen.

A full pass (:mod:`cni.cluster.network`) repairs any drift, but it ran only every ``resync_seconds``: a route of ours
deleted by hand (``ip route flush``), an FDB entry removed, or the kernel's own removal of every IPv4 route through a
device that went down (which it announces to nobody) left the node without its way to a peer's pods for up to that
long. :class:`DriftWatch` listens in the agent's netns for what can cause it and asks for a full pass at once:

- ``RTM_DELROUTE`` of a route carrying the agent's protocol;
- ``RTM_NEWLINK`` / ``RTM_DELLINK`` of any device but the pods' own (a host-side veth, ``veth`` + hex digits, and
  the pod bridge, both marked by their alias as nodeplug's: they change with every pod's ADD and DEL): a device going
  down or up, renamed or gone, the underlay the routes leave by or the VXLAN device;
- ``RTM_DELNEIGH`` of an FDB or neighbour entry on the VXLAN device.

A socket filter (:mod:`cni.dataplane.sockfilter`) keeps every other event (route and neighbour additions, the
neighbour cache's churn) from waking the event loop. Events that arrive while a pass runs fold into the next one;
the passes' own deletions of stale routes come back as events too and cost one more full pass, which finds nothing
left to do. A listener that falls behind (ENOBUFS: events were lost) asks for a full pass as well.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

from cni.cluster import kernel, rawnl
from cni.dataplane import sockfilter
from cni.dataplane.names import ALIAS_PREFIX, is_host_veth_name
from cni.dataplane.nlwire import messages
from cni.dataplane.rtnl import RTM_DELLINK, RTM_DELNEIGH, RTM_DELROUTE, RTM_NEWLINK

RTMGRP_LINK, RTMGRP_NEIGH, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE = 0x1, 0x4, 0x40, 0x400
_RECV = 1 << 16


def _pods_own(link: rawnl.Link) -> bool:
    """A pod's host-side veth or the pod bridge (each carries an alias of nodeplug's)."""
    return is_host_veth_name(link.name) or link.alias.startswith(
        ALIAS_PREFIX
    )  # the pod bridge's too (names.BRIDGE_ALIAS)


def drift_in(data: memoryview | bytes, protocol: int, vxlan_index: Callable[[], int | None]) -> str:
    """Why the events in ``data`` (one datagram) call for a full pass, or "" when none does."""
    for msg_type, _, _, view in messages(data):
        msg = bytes(view)
        if msg_type == RTM_DELROUTE:
            r = rawnl.route(msg)
            if r is not None and r.protocol == protocol:
                return "a route of ours was deleted"
        elif msg_type in (RTM_NEWLINK, RTM_DELLINK):
            link = rawnl.link(msg)
            if link is not None and not _pods_own(link):
                return f"device {link.name or '?'} {'changed' if msg_type == RTM_NEWLINK else 'was deleted'}"
        elif msg_type == RTM_DELNEIGH:
            n = rawnl.neighbour(msg)
            if n is not None and n.ifindex == vxlan_index():
                return f"an FDB or neighbour entry on {kernel.VXLAN_DEVICE} was deleted"
    return ""


def pod_links_in(data: memoryview | bytes) -> bool:
    """Whether the events in ``data`` add, change or delete a pod's host veth or the pod bridge (the redirect's
    attachments follow them: :mod:`cni.redirect.manager`)."""
    for msg_type, _, _, view in messages(data):
        if msg_type in (RTM_NEWLINK, RTM_DELLINK):
            link = rawnl.link(bytes(view))
            if link is not None and _pods_own(link):
                return True
    return False


def _vxlan_index() -> int | None:
    try:
        return socket.if_nametoindex(kernel.VXLAN_DEVICE)
    except OSError:
        return None


class DriftWatch:
    """A non-blocking netlink listener in the calling thread's netns; :meth:`read` drains it."""

    def __init__(self, protocol: int) -> None:
        self.protocol = protocol
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        try:
            sockfilter.attach(sock, sockfilter.types_only([RTM_DELROUTE, RTM_NEWLINK, RTM_DELLINK, RTM_DELNEIGH]))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.bind((0, RTMGRP_LINK | RTMGRP_NEIGH | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.pod_links = False  # a pod's host veth or the pod bridge came, changed or went since last cleared

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> str:
        """Every event queued now: why a full pass is needed, or "" (the first reason found is given)."""
        why = ""
        while True:
            try:
                data = self.sock.recv(_RECV)
            except BlockingIOError:
                return why
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                why = why or "kernel events were lost (the listener fell behind)"
                continue
            if not data:
                return why
            why = why or drift_in(data, self.protocol, _vxlan_index)
            self.pod_links = self.pod_links or pod_links_in(data)

    def close(self) -> None:
        self.sock.close()
