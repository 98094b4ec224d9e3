"""ADD and DEL of one attachment (container id + ifname), on the bridge or the routed datapath (:mod:`routed`).

ADD, in order, each step registering its undo on an :class:`~contextlib.ExitStack` that is unwound when a later step
fails (``pop_all()`` on success):

1. open the pod netns file and a netlink socket in the calling thread's (host) netns;
2. the bridge (:mod:`bridge`; shared, so never undone) — not on the routed datapath;
3. the veth pair, the peer created inside the pod as ``ifname`` (:mod:`veth`) — undo: delete the host end; routed:
   ``accept_dad=0`` on the host end;
4. from inside the pod netns: a netlink socket there, the index of ``ifname``, and ``accept_dad=0`` on it when IPv6 is
   used;
5. bridge: the host port: hairpin, VLAN, alias, up;
6. the pod side: loopback, addresses, up, (routed: the gateways' neighbour entries,) routes, in one batch
   (:mod:`addrs`) — undone with the pair;
7. routed: the host end's alias and up and a host route to each pod address through it, in one batch
   (:func:`routed.bring_up`) — undone with the pair; the network's bridge, if one is left from the bridge datapath,
   answers for the pod (:mod:`routed`);
8. forwarding sysctls on the host (``isGateway``; always when routed);
9. masquerade rules (``ipMasq``, :mod:`masq`) — undo: delete the attachment's rules.

DEL deletes the host end (which takes the pod end with it, wherever it is; answered once the kernel has unregistered
the pair, its slower remainder left to the kernel: :mod:`unlink`) and, when ADD put masquerade rules in place
(the host veth's alias says so, :mod:`names`; or ``ipMasq`` is on and the veth is gone or older than that mark), the
attachment's rules, side by side (each waits for a kernel RCU grace period; together DEL takes about as long as the
slower of the two). Without rules it runs no ``nft`` and imports nothing to run it. It needs neither the netns nor the
addresses, and treats everything already gone as done.

The pod's netns is checked (:func:`cni.dataplane.netns.check_netns`) by the orchestration before any address is
leased; ADD opens it again the same way, so whatever ``CNI_NETNS`` names, nothing here blocks on it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from cni.dataplane import masq, names, routed, sysctl
from cni.dataplane.addrs import configure_pod
from cni.dataplane.bridge import ensure_bridge
from cni.dataplane.netns import open_netns, same_netns
from cni.dataplane.nl import get_link, host_socket, socket_in
from cni.dataplane.unlink import delete_pair
from cni.dataplane.veth import configure_host_port, create_pair, delete_host_end, index_of
from cni.errors import INVALID_ENVIRONMENT, CniError, quietly
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
    """Attach the pod: returns ``[bridge, host veth, container interface]`` (routed: ``[host veth, container
    interface]``); on failure nothing of it is left."""
    host_name = names.host_veth_name(container_id, ifname)
    families = {ip.version for ip in ips}
    nsfd = open_netns(netns)
    try:
        if same_netns(nsfd):
            raise CniError(INVALID_ENVIRONMENT, details=f"CNI_NETNS {netns} is the host's own network namespace")
        with host_socket() as nl, contextlib.ExitStack() as undo:
            br_index, br_iface = (None, None) if conf.routed else ensure_bridge(nl, conf, ips)
            host_iface, pod_iface = create_pair(nl, conf, br_index, host_name, nsfd, netns, ifname)
            undo.callback(quietly, delete_host_end, nl, host_name)
            if conf.routed:
                routed.before_up(host_name, families)
            pod_index: list[int] = []

            def inside_pod() -> None:
                pod_index.append(index_of(ifname))
                if 6 in families:
                    sysctl.ensure(sysctl.conf_key(6, ifname, "accept_dad"), "0", missing_ok=True)

            masquerade = conf.ip_masq and bool(ips)
            with socket_in(nsfd, netns, inside_pod) as nsr:
                alias = names.alias(conf.name, container_id, ifname, masquerade)
                if conf.routed:
                    gateways = routed.gateways(families, host_iface.mac)
                    configure_pod(nsr, netns, ifname, pod_index[0], routed.host_ips(ips), routes, gateways)
                else:
                    configure_host_port(nl, conf, host_name, alias)
                    configure_pod(nsr, netns, ifname, pod_index[0], ips, routes)
            if conf.routed:
                routed.bring_up(nl, host_name, index_of(host_name), alias, ips)
                answered = routed.answer_on_bridge(nl, conf.bridge, ips)
                undo.callback(quietly, routed.forget_on_bridge, nl, conf.bridge, answered)
            if conf.is_gateway or conf.routed:
                _forwarding(families)
            if masquerade:
                undo.callback(quietly, masq.delete_attachment, conf.name, host_name)
                masq.add_rules(conf.name, host_name, container_id, [ip.address for ip in ips])
            undo.pop_all()
            return [host_iface, pod_iface] if br_iface is None else [br_iface, host_iface, pod_iface]
    finally:
        os.close(nsfd)


def delete(conf: BridgeConf, container_id: str, netns: str | None, ifname: str, ips: Sequence[IPConfig]) -> None:
    """Detach the pod; idempotent, and needs neither the netns nor ``ips`` (rules are found by their comment; the
    bridge's proxy entries for a routed pod's ``ips`` are removed when given, else by GC)."""
    host_name = names.host_veth_name(container_id, ifname)
    with host_socket() as nl:
        link = get_link(nl, host_name)
        if link is None or not link.get("IFLA_MASTER"):  # routed (or gone): the bridge may answer for it
            routed.forget_on_bridge(nl, conf.bridge, [ip.address.ip for ip in ips])
        recorded = names.alias_masq(str(link.get("IFLA_IFALIAS") or "")) if link is not None else None
        if not (conf.ip_masq if recorded is None else recorded):
            if link is not None:
                delete_pair(host_name, int(link["index"]))
            return
        # The rules go side by side with the link (the nft listing and deletion transaction wait for a kernel RCU grace
        # period). The pool's thread is started here, so it shares this thread's netns and nft runs where the rules are.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1, thread_name_prefix="nodeplug-cni-nft") as pool:
            rules = pool.submit(masq.delete_attachment, conf.name, host_name)
            try:
                if link is not None:
                    delete_pair(host_name, int(link["index"]))
            finally:
                rules.result()


def _forwarding(families: set[int]) -> None:
    if 4 in families:
        sysctl.ensure("net/ipv4/ip_forward", "1")
    if 6 in families:
        sysctl.ensure("net/ipv6/conf/all/forwarding", "1")
