"""nodeplug as another plugin's IPAM (``"ipam": {"type": "nodeplug", ...}`` under, say, the reference ``bridge``).

The calling plugin execs us with its own config; :func:`cni.netconf.is_ipam_invocation` recognises it (top-level type
not ours, ``ipam.type`` ours) and these handlers answer as an IPAM plugin does: ADD returns ``ips`` (no interface
index), the configured routes and DNS, and no interfaces; DEL releases; CHECK verifies the leases; GC releases every
lease not in ``cni.dev/valid-attachments``; STATUS reports whether an address can be leased.
"""

from __future__ import annotations

from cni.errors import UNKNOWN_CONTAINER, CniError
from cni.ipam import service
from cni.ipam.service import StoreOpener
from cni.netconf import IpamPluginConf
from cni.skel import Request
from cni.types import Result


def add(req: Request, conf: IpamPluginConf, opener: StoreOpener | None = None) -> Result:
    ipam = conf.ipam_conf
    requested = service.requested_ips(conf.runtime_config, conf.args, req.args.ips)
    ips, _ = service.add(conf.name, ipam, req.container_id, req.ifname, requested, opener)
    return Result(cni_version=conf.cni_version, ips=tuple(ips), routes=ipam.routes, dns=ipam.dns)


def delete(req: Request, conf: IpamPluginConf, opener: StoreOpener | None = None) -> None:
    service.release(conf.name, conf.ipam_conf, req.container_id, req.ifname, opener)


def check(req: Request, conf: IpamPluginConf, opener: StoreOpener | None = None) -> None:
    ips = conf.prev_result.ips if conf.prev_result is not None else ()
    if not ips:  # no prevResult: at least the container must hold a lease
        ips = tuple(service.leased(conf.name, conf.ipam_conf, req.container_id, req.ifname, opener))
        if not ips:
            raise CniError(
                UNKNOWN_CONTAINER,
                details=f"container {req.container_id} ifname {req.ifname} holds no address here (deleted?)",
            )
    service.check(conf.name, conf.ipam_conf, req.container_id, req.ifname, ips, opener)


def gc(req: Request, conf: IpamPluginConf, opener: StoreOpener | None = None) -> None:
    service.gc(conf.name, conf.ipam_conf, conf.valid_attachments or (), opener)


def status(req: Request, conf: IpamPluginConf, opener: StoreOpener | None = None) -> None:
    service.require_available(conf.name, conf.ipam_conf, opener)
