"""CNI commands (ADD, DEL, CHECK, GC, STATUS) as a table of handlers over IPAM and the dataplane.

:func:`table` builds the handler table :func:`cni.skel.run` dispatches on. Each handler takes a validated
:class:`cni.skel.Request`; bridge-mode configs run IPAM and the dataplane, IPAM-plugin-mode configs go to
:mod:`cni.ipam.pluginmode`.

- ADD: the netns checked (``dataplane.check_netns``: a network namespace, not the host's; it never blocks, whatever
  the path names) -> IPAM (built in or delegated) -> routes resolved (each route's gateway filled in from its family's
  address, on the routed datapath the link-local gateway of :mod:`cni.datapath`, which also gets a route to each
  address's subnet; default routes for ``isDefaultGateway``) -> ``dataplane.add`` -> the pod's addresses told to
  policy enforcement (:class:`PodAddresses`: the pod's rules are in place, or its addresses quarantined, before ADD
  answers); on the routed datapath the result's addresses are host addresses (/32, /128) as the pod has them. If a
  step fails, what the earlier ones did is undone (the interface removed, the lease released or the delegate's DEL
  run) before the error is returned: a failed ADD leaves no lease.
- DEL: the addresses (from the store, or prevResult for a delegate) -> ``dataplane.delete`` (idempotent; a missing
  netns or veth is fine) -> the addresses told freed to policy enforcement (out of every set, quarantined) ->
  release. The lease is only released once neither the dataplane nor a policy rule uses the address.
- CHECK: prevResult required and naming the container's interface (code 7 otherwise); its addresses are leased to
  this container; ``dataplane.check`` against it. An attachment of which nothing is left (no lease, no host veth:
  CHECK after DEL) is code 3, which tells the runtime there is nothing to clean up; one that is only partly there is a
  failed CHECK.
- GC: ``cni.dev/valid-attachments`` required; every other lease released (its address told freed); ``dataplane.gc``.
- STATUS: the store opens and every range set has a free address (code 50 otherwise); ``dataplane.status``.

The contract between this orchestration and the dataplane (:mod:`cni.dataplane`):

:mod:`cni.dataplane` (rtnetlink of its own, nftables through ``nft``) implements these functions at module
level; :mod:`cni.commands` calls them through the :class:`Dataplane` protocol so its logic is tested with a fake.

- ``check_netns(netns)``: raises CniError 4 unless ``netns`` (a path) is a network namespace other than the host's;
  never blocks, whatever the path names (a FIFO, a device).

- ``add(conf, container_id, netns, ifname, ips, routes) -> [bridge, host veth, container iface]`` (routed:
  ``[host veth, container iface]``): makes the bridge (if missing; gateway addresses from ``ips[].gateway`` with the
  address's prefix when ``conf.is_gateway``; none on the routed datapath), the veth pair (host end on the bridge, or
  routed: a host route to each pod address on it; the other moved into ``netns`` (a path) and renamed ``ifname``),
  MTU, hairpin, promisc, vlan, the ``ips`` addresses (routed: as host addresses, with the gateways' neighbour
  entries) and exactly the ``routes`` given (the orchestration has already filled in each route's ``gw`` and added
  the default routes for ``isDefaultGateway``; a route whose ``gw`` is None is a link route), loopback up, DAD off on
  the pod side, forwarding sysctls, ipMasq rules. The ``IPConfig.interface`` indices the orchestration puts in the
  Result point at the last interface of the returned list. On failure it undoes everything it did and raises
  :class:`cni.errors.CniError`.
- ``delete(conf, container_id, netns | None, ifname, ips)``: idempotent; succeeds when the netns or the veth is gone;
  removes the ipMasq rules for ``ips``.
- ``check(conf, container_id, netns, ifname, prev)``: raises CniError when the interface, addresses, routes or
  masquerade rules differ from ``prev`` (code 3 when the attachment's host veth is not there at all).
- ``gc(conf, valid)``: removes our host veths and nft rules for attachments of this network not in ``valid``
  (``(container_id, ifname)`` pairs).
- ``status(conf)``: raises CniError 50 when ADD cannot work (no netlink, no nft when ipMasq is set, ...).

Standard library only apart from the dataplane the caller passes in.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable, Collection, Sequence
from typing import Protocol, TypeVar

from cni import datapath
from cni.errors import DATAPLANE, INVALID_NETWORK_CONFIG, UNKNOWN_CONTAINER, CniError, quietly
from cni.ipam import delegate, pluginmode, service
from cni.ipam.service import StoreOpener
from cni.netconf import BridgeConf, IpamPluginConf
from cni.skel import Handler, Request
from cni.types import Interface, IPAddress, IPConfig, Result, Route


class PodAddresses(Protocol):
    """Policy enforcement's side of ADD and DEL (:mod:`cni.policy`): told of a pod's new addresses before ADD answers,
    and of freed addresses before they go back to the IPAM. Each call returns once it is done; raising fails the
    command (the ADD is undone)."""

    def added(self, namespace: str, name: str, uid: str, ips: Sequence[str]) -> None: ...

    def freed(self, ips: Sequence[str]) -> None: ...


class Quarantine:
    """What the standalone entry point (the agent not answering) tells: every address it gives out or frees is
    quarantined (:mod:`cni.policy.quarantine`) until the policy agent has the rules of the pod that holds it; nothing
    when this node enforces no policy."""

    def added(self, namespace: str, name: str, uid: str, ips: Sequence[str]) -> None:
        if namespace and name:  # a Kubernetes pod (K8S_POD_* in CNI_ARGS): policies may name it
            self.freed(ips)

    def freed(self, ips: Sequence[str]) -> None:
        from cni.policy import quarantine

        if not ips:
            return
        try:
            quarantine.hold(ips)
        except quarantine.QuarantineError as e:
            raise CniError(DATAPLANE, details=f"network policy: {e}") from None


class Dataplane(Protocol):
    def check_netns(self, netns: str) -> None: ...

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


def resolve_routes(conf: BridgeConf, ips: Sequence[IPConfig], routes: Sequence[Route]) -> list[Route]:
    """Fill each route's gateway from its family's address (as host-local + bridge do); add isDefaultGateway routes."""
    gw_of: dict[int, IPAddress] = {}
    for ip in ips:
        if ip.gateway is not None:
            gw_of.setdefault(ip.version, ip.gateway)
    out = [r if r.gw is not None or r.dst.version not in gw_of else r._replace(gw=gw_of[r.dst.version]) for r in routes]
    if conf.is_default_gateway:
        for version, gw in sorted(gw_of.items()):
            default = ipaddress.ip_network("0.0.0.0/0" if version == 4 else "::/0")
            if not any(r.dst == default for r in out):
                out.append(Route(default, gw))
    return out


def with_subnet_routes(ips: Sequence[IPConfig], routes: Sequence[Route]) -> list[Route]:
    """Routed: each address's subnet via its gateway (unless a route names it already), so that a routed pod reaches
    what a bridged one reaches on its link, whether or not it has a default route."""
    out = list(routes)
    for ip in ips:
        if ip.gateway is not None and not any(r.dst == ip.address.network for r in out):
            out.append(Route(ip.address.network, ip.gateway))
    return out


def _container_interface(prev: Result, ifname: str) -> None:
    """Code 7 unless prevResult (the result of ADD) names ``ifname`` with its sandbox, as ADD reports it."""
    if not any(i.name == ifname and i.sandbox for i in prev.interfaces):
        raise CniError(
            INVALID_NETWORK_CONFIG,
            details=f"prevResult.interfaces: no interface {ifname} with a sandbox (expected the result of ADD for this "
            "attachment)",
        )


R = TypeVar("R", Result, None)
PluginModeHandler = Callable[[Request, IpamPluginConf, StoreOpener | None], R]


def _valid_attachments(conf: BridgeConf | IpamPluginConf) -> Collection[tuple[str, str]]:
    """GC's ``cni.dev/valid-attachments``, required whatever the mode."""
    if conf.valid_attachments is None:
        raise CniError(
            INVALID_NETWORK_CONFIG, details="cni.dev/valid-attachments: required for GC (the attachments to keep)"
        )
    return conf.valid_attachments


def _gc_in_plugin_mode(req: Request, conf: IpamPluginConf, opener: StoreOpener | None) -> None:
    _valid_attachments(conf)
    pluginmode.gc(req, conf, opener)


class Commands:
    """The handlers, bound to a dataplane and (for tests) a store opener."""

    def __init__(
        self, dataplane: Dataplane, opener: StoreOpener | None = None, addresses: PodAddresses | None = None
    ) -> None:
        self.dp = dataplane
        self.opener = opener
        self.addresses = addresses if addresses is not None else Quarantine()

    # ------------------------------------------------------------ ADD

    def add(self, req: Request, conf: BridgeConf) -> Result:
        ips: list[IPConfig] = []
        ipam_routes: Sequence[Route] = ()
        dns = conf.dns
        self.dp.check_netns(req.netns)  # before anything is leased: a bad netns changes nothing
        with contextlib.ExitStack() as undo:
            if conf.ipam_conf is not None:
                requested = service.requested_ips(conf.runtime_config, conf.args, req.args.ips)
                ipam_conf = conf.ipam_conf
                ips, fresh = service.add(conf.name, ipam_conf, req.container_id, req.ifname, requested, self.opener)
                if fresh:  # a repeated ADD must not release the lease of the attachment that holds it
                    undo.callback(
                        quietly, service.release, conf.name, ipam_conf, req.container_id, req.ifname, self.opener
                    )
                ipam_routes = conf.ipam_conf.routes
                dns = dns or conf.ipam_conf.dns
            elif conf.ipam_type:
                got = delegate.ipam_add(conf.ipam_type, req.env, req.stdin, req.path)
                undo.callback(quietly, delegate.exec_plugin, conf.ipam_type, "DEL", req.env, req.stdin, req.path)
                ips = [ip._replace(interface=None) for ip in got.ips]
                ipam_routes = got.routes
                dns = dns or got.dns
            if conf.routed:  # the pod's routes go via the link-local gateway, whatever the IPAM's subnets say
                ips = [datapath.with_routed_gateway(ip) for ip in ips]
            routes = resolve_routes(conf, ips, ipam_routes)
            if conf.routed:
                routes = with_subnet_routes(ips, routes)
            interfaces = self.dp.add(conf, req.container_id, req.netns, req.ifname, ips, routes)
            if ips:
                undo.callback(quietly, self.dp.delete, conf, req.container_id, req.netns, req.ifname, ips)
                args = req.args
                self.addresses.added(args.k8s_pod_namespace, args.k8s_pod_name, args.k8s_pod_uid, _texts(ips))
            undo.pop_all()
        if conf.routed:
            ips = [datapath.host_address(ip) for ip in ips]
        return Result(
            cni_version=conf.cni_version,
            interfaces=tuple(interfaces),
            ips=tuple(ip._replace(interface=len(interfaces) - 1) for ip in ips),
            routes=tuple(routes),
            dns=dns,
        )

    # ------------------------------------------------------------ DEL

    def delete(self, req: Request, conf: BridgeConf) -> None:
        if conf.ipam_conf is not None:
            ips = service.leased(conf.name, conf.ipam_conf, req.container_id, req.ifname, self.opener)
        else:
            ips = list(conf.prev_result.ips) if conf.prev_result is not None else []
        self.dp.delete(conf, req.container_id, req.netns or None, req.ifname, ips)
        self.addresses.freed(_texts(ips))
        if conf.ipam_conf is not None:
            service.release(conf.name, conf.ipam_conf, req.container_id, req.ifname, self.opener)
        elif conf.ipam_type:
            delegate.exec_plugin(conf.ipam_type, "DEL", req.env, req.stdin, req.path)

    # ------------------------------------------------------------ CHECK

    def check(self, req: Request, conf: BridgeConf) -> None:
        prev = conf.prev_result
        if prev is None:
            raise CniError(INVALID_NETWORK_CONFIG, details="prevResult: required for CHECK (the result of ADD)")
        _container_interface(prev, req.ifname)
        if conf.ipam_conf is not None:  # code 3 when the container holds no address: nothing of it is here
            service.check(conf.name, conf.ipam_conf, req.container_id, req.ifname, prev.ips, self.opener)
        elif conf.ipam_type:
            delegate.exec_plugin(conf.ipam_type, "CHECK", req.env, req.stdin, req.path)
        try:
            self.dp.check(conf, req.container_id, req.netns, req.ifname, prev)
        except CniError as e:
            if e.code != UNKNOWN_CONTAINER or not (conf.ipam_conf is not None or conf.ipam_type):
                raise
            # the addresses are still held: the host having lost the rest is a failed CHECK (DEL must clean up)
            raise CniError(DATAPLANE, "CHECK failed", e.details) from None

    # ------------------------------------------------------------ GC

    def gc(self, req: Request, conf: BridgeConf) -> None:
        valid = _valid_attachments(conf)
        if conf.ipam_conf is not None:
            gone = service.gc(conf.name, conf.ipam_conf, valid, self.opener)
            self.addresses.freed([lease.ip for lease in gone])
        elif conf.ipam_type:
            delegate.exec_plugin(conf.ipam_type, "GC", req.env, req.stdin, req.path)
        self.dp.gc(conf, valid)

    # ------------------------------------------------------------ STATUS

    def status(self, req: Request, conf: BridgeConf) -> None:
        if conf.ipam_conf is not None:
            service.require_available(conf.name, conf.ipam_conf, self.opener)
        elif conf.ipam_type:
            delegate.exec_plugin(conf.ipam_type, "STATUS", req.env, req.stdin, req.path)
        self.dp.status(conf)

    def table(self) -> dict[str, Handler]:
        """Each command: a config in IPAM-plugin mode goes to :mod:`cni.ipam.pluginmode`, a bridge config to the
        method here."""
        return {
            "ADD": self._route(pluginmode.add, self.add),
            "DEL": self._route(pluginmode.delete, self.delete),
            "CHECK": self._route(pluginmode.check, self.check),
            "GC": self._route(_gc_in_plugin_mode, self.gc),
            "STATUS": self._route(pluginmode.status, self.status),
        }

    def _route(
        self, in_plugin_mode: PluginModeHandler[R], bridge: Callable[[Request, BridgeConf], R]
    ) -> Callable[[Request], R]:
        def handle(req: Request) -> R:
            conf = req.conf
            if isinstance(conf, IpamPluginConf):
                return in_plugin_mode(req, conf, self.opener)
            assert isinstance(conf, BridgeConf)
            return bridge(req, conf)

        return handle


def _texts(ips: Sequence[IPConfig]) -> list[str]:
    return [str(ip.address.ip) for ip in ips]


def table(
    dataplane: Dataplane, opener: StoreOpener | None = None, addresses: PodAddresses | None = None
) -> dict[str, Handler]:
    return Commands(dataplane, opener, addresses).table()
