"""CNI commands (ADD, DEL, CHECK, GC, STATUS) over IPAM and the dataplane. (Orchestration lands next; the dataplane
contract below is fixed.)

The contract between this orchestration and the dataplane (:mod:`cni.dataplane`):

:mod:`cni.dataplane` (netlink through pyroute2, nftables through ``nft``) implements these five functions at module
level; :mod:`cni.commands` calls them through the :class:`Dataplane` protocol so its logic is tested with a fake.

- ``add(conf, container_id, netns, ifname, ips, routes) -> [bridge, host veth, container iface]``: makes the bridge
  (if missing; gateway addresses from ``ips[].gateway`` with the address's prefix when ``conf.is_gateway``), the veth
  pair (host end on the bridge; the other moved into ``netns`` (a path) and renamed ``ifname``), MTU, hairpin, promisc,
  vlan, the ``ips`` addresses and exactly the ``routes`` given (the orchestration has already filled in each route's
  ``gw`` and added the default routes for ``isDefaultGateway``; a route whose ``gw`` is None is a link route), loopback
  up, DAD off on the pod side, forwarding sysctls, ipMasq rules. The ``IPConfig.interface`` indices the orchestration
  puts in the Result point at index 2 of the returned list. On failure it undoes everything it did and raises
  :class:`cni.errors.CniError`.
- ``delete(conf, container_id, netns | None, ifname, ips)``: idempotent; succeeds when the netns or the veth is gone;
  removes the ipMasq rules for ``ips``.
- ``check(conf, container_id, netns, ifname, prev)``: raises CniError when the interface, addresses or routes in the
  netns differ from ``prev``.
- ``gc(conf, valid)``: removes our host veths and nft rules for attachments of this network not in ``valid``
  (``(container_id, ifname)`` pairs).
- ``status(conf)``: raises CniError 50 when ADD cannot work (no netlink, no nft when ipMasq is set, ...).

Standard library only (it is imported by the orchestration, which the agent and the standalone fallback share).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from cni.netconf import BridgeConf
from cni.types import Interface, IPConfig, Result, Route


class Dataplane(Protocol):
    def add(
        self,
        conf: BridgeConf,
        container_id: str,
        netns: str,
        ifname: str,
        ips: Sequence[IPConfig],
        routes: Sequence[Route],
    ) -> list[Interface]: ...

    def delete(
        self, conf: BridgeConf, container_id: str, netns: str | None, ifname: str, ips: Sequence[IPConfig]
    ) -> None: ...

    def check(self, conf: BridgeConf, container_id: str, netns: str, ifname: str, prev: Result) -> None: ...

    def gc(self, conf: BridgeConf, valid: Collection[tuple[str, str]]) -> None: ...

    def status(self, conf: BridgeConf) -> None: ...
