"""ADD and DEL of one attachment (container id + ifname) on a bridge network.

ADD, in order, each step registering its undo on an :class:`~contextlib.ExitStack` that is unwound when a later step
fails (``pop_all()`` on success):

1. open the pod netns file and a netlink socket in the calling thread's (host) netns;
2. the bridge (:mod:`bridge`; shared, so never undone);
3. the veth pair, the peer created inside the pod as ``ifname`` (:mod:`veth`) — undo: delete the host end;
4. from inside the pod netns: a netlink socket there, the index of ``ifname``, and ``accept_dad=0`` on it when IPv6 is
   used;
5. the host port: hairpin, VLAN, alias, up;
6. the pod side: loopback, addresses, up, routes (:mod:`addrs`) — undone with the pair;
7. forwarding sysctls on the host (``isGateway``);
8. masquerade rules (``ipMasq``, :mod:`masq`) — undo: delete the attachment's rules.

DEL deletes the host end (which takes the pod end with it, wherever it is) and the attachment's rules (whatever
``ipMasq`` says now), side by side (each waits for a kernel RCU grace period; together DEL takes about as long as the
slower of the two). It needs neither the netns nor the addresses, and treats everything already gone as done.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cni.dataplane import masq, names, sysctl
from cni.dataplane.addrs import configure_pod
from cni.dataplane.bridge import ensure_bridge
from cni.dataplane.netns import open_netns, same_netns
from cni.dataplane.nl import host_socket, socket_in
from cni.dataplane.veth import configure_host_port, create_pair, delete_host_end, index_of
from cni.errors import INVALID_ENVIRONMENT, CniError
from cni.netconf import BridgeConf
from cni.types import Interface, IPConfig, Route


def add(
    conf: BridgeConf,
    container_id: str,
    netns: str,
    ifname: str,
    ips: Sequence[IPConfig],
    routes: Sequence[Route],
) -> list[Interface]:
    """Attach the pod: returns ``[bridge, host veth, container interface]``; on failure nothing of it is left."""
    host_name = names.host_veth_name(container_id, ifname)
    families = {ip.version for ip in ips}
    nsfd = open_netns(netns)
    try:
        if same_netns(nsfd):
            raise CniError(INVALID_ENVIRONMENT, details=f"CNI_NETNS {netns} is the host's own network namespace")
        with host_socket() as nl, contextlib.ExitStack() as undo:
            br_index, br_iface = ensure_bridge(nl, conf, ips)
            host_iface, pod_iface = create_pair(nl, conf, br_index, host_name, nsfd, netns, ifname)
            undo.callback(_quietly, delete_host_end, nl, host_name)
            pod_index: list[int] = []

            def inside_pod() -> None:
                pod_index.append(index_of(ifname))
                if 6 in families:
                    sysctl.ensure(sysctl.conf_key(6, ifname, "accept_dad"), "0", missing_ok=True)

            with socket_in(nsfd, netns, inside_pod) as nsr:
                configure_host_port(nl, conf, host_name, names.alias(conf.name, container_id, ifname))
                configure_pod(nsr, netns, ifname, pod_index[0], ips, routes)
            if conf.is_gateway:
                _forwarding(families)
            if conf.ip_masq and ips:
                undo.callback(_quietly, masq.delete_attachment, conf.name, host_name)
                masq.add_rules(conf.name, host_name, container_id, [ip.address for ip in ips])
            undo.pop_all()
            return [br_iface, host_iface, pod_iface]
    finally:
        os.close(nsfd)


def delete(conf: BridgeConf, container_id: str, netns: str | None, ifname: str, ips: Sequence[IPConfig]) -> None:
    """Detach the pod; idempotent, and needs neither the netns nor ``ips`` (rules are found by their comment)."""
    host_name = names.host_veth_name(container_id, ifname)
    # The rules are looked for even when ipMasq is off now (it may have been on at ADD time), side by side with the link
    # deletion: that waits for a kernel RCU grace period anyway, so the nft listing (and a deletion transaction, which
    # waits for one too) costs no extra wall time. A thread started here shares this thread's netns, so nft runs where
    # the rules are.
    rules = _Background(masq.delete_attachment, conf.name, host_name)
    try:
        with host_socket() as nl:
            delete_host_end(nl, host_name)
    finally:
        rules.result()


def _forwarding(families: set[int]) -> None:
    if 4 in families:
        sysctl.ensure("net/ipv4/ip_forward", "1")
    if 6 in families:
        sysctl.ensure("net/ipv6/conf/all/forwarding", "1")


class _Background:
    """Run ``fn(*args)`` on a new thread; :meth:`result` joins it and re-raises its exception."""

    def __init__(self, fn: Callable[..., object], *args: Any) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:
                self._error = e

        self._thread = threading.Thread(target=run, name="nodeplug-cni-nft", daemon=True)
        self._thread.start()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _quietly(fn: Callable[..., object], *args: Any) -> None:
    """Run an undo step; its own failure must not hide the error that caused the rollback."""
    with contextlib.suppress(Exception):
        fn(*args)
