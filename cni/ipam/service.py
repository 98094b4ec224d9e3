"""IPAM operations as the orchestration sees them: built in (allocator over the SQLite store) or delegated.

Each function takes the network name and the parsed ``ipam`` section and does one thing in one store transaction.
:mod:`cni.commands` calls these for bridge mode; :mod:`cni.ipam.pluginmode` for nodeplug acting as another plugin's
IPAM. Requested addresses (host-local's conventions) come from ``runtimeConfig.ips`` (capability ``ips``),
``args.cni.ips`` and ``CNI_ARGS`` ``IP=``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from cni.errors import INVALID_NETWORK_CONFIG, IPAM_STORE, PLUGIN_NOT_AVAILABLE, TRY_AGAIN_LATER, CniError
from cni.ipam import allocator
from cni.ipam.sqlite import open_store
from cni.ipam.store import Lease, Store
from cni.netconf import IpamConf
from cni.types import IPAddress, IPConfig

StoreOpener = Callable[[str, str], Store]  # (data_dir, network) -> store; tests pass a memory store factory


def _open(network: str, ipam: IpamConf, opener: StoreOpener | None) -> Store:
    return (opener or open_store)(ipam.data_dir, network)


def requested_ips(
    runtime_config: Mapping[str, Any], args: Mapping[str, Any], cni_args_ips: Sequence[str]
) -> list[IPAddress]:
    """Addresses the runtime asked for, from any of the three conventions (first non-empty wins)."""
    sources: list[tuple[str, Any]] = [
        ("runtimeConfig.ips", runtime_config.get("ips")),
        ("args.cni.ips", (args.get("cni") or {}).get("ips") if isinstance(args.get("cni"), dict) else None),
        ("CNI_ARGS IP", list(cni_args_ips) or None),
    ]
    for where, value in sources:
        if not value:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise CniError(INVALID_NETWORK_CONFIG, details=f"{where}: expected a list of IP addresses, got {value!r}")
        out = []
        for v in value:
            try:
                out.append(ipaddress.ip_address(v.split("/", 1)[0]))
            except ValueError:
                raise CniError(INVALID_NETWORK_CONFIG, details=f"{where}: expected an IP address, got {v!r}") from None
        return out
    return []


def add(
    network: str,
    ipam: IpamConf,
    container_id: str,
    ifname: str,
    requested: Sequence[IPAddress] = (),
    opener: StoreOpener | None = None,
) -> tuple[list[IPConfig], bool]:
    """Lease (or find again) the attachment's addresses in one transaction, and whether this call made the lease
    (False: the attachment already held it, so undoing a failed ADD must not release it)."""
    if not ipam.ranges:  # ranges from the node's podCIDRs, and it has none (yet): never guess one
        raise CniError(TRY_AGAIN_LATER, details=ipam.no_ranges or "ipam: no ranges")
    with _open(network, ipam, opener).transaction() as txn:
        fresh = not txn.leases_of(container_id, ifname)
        return allocator.allocate(txn, ipam, container_id, ifname, requested), fresh


def leased(
    network: str, ipam: IpamConf, container_id: str, ifname: str, opener: StoreOpener | None = None
) -> list[IPConfig]:
    with _open(network, ipam, opener).transaction() as txn:
        return allocator.leased(txn, ipam, container_id, ifname)


def release(
    network: str, ipam: IpamConf, container_id: str, ifname: str, opener: StoreOpener | None = None
) -> list[Lease]:
    with _open(network, ipam, opener).transaction() as txn:
        return allocator.release(txn, container_id, ifname)


def gc(
    network: str, ipam: IpamConf, valid: Collection[tuple[str, str]], opener: StoreOpener | None = None
) -> list[Lease]:
    with _open(network, ipam, opener).transaction() as txn:
        return allocator.gc(txn, valid)


def check(
    network: str,
    ipam: IpamConf,
    container_id: str,
    ifname: str,
    ips: Sequence[IPConfig],
    opener: StoreOpener | None = None,
) -> None:
    with _open(network, ipam, opener).transaction() as txn:
        allocator.check(txn, container_id, ifname, ips)


def status(network: str, ipam: IpamConf, opener: StoreOpener | None = None) -> list[int]:
    """Free addresses per range set; raises code 103 when the store cannot be used."""
    with _open(network, ipam, opener).transaction() as txn:
        return allocator.free_counts(txn, ipam)


def require_available(network: str, ipam: IpamConf, opener: StoreOpener | None = None) -> None:
    """STATUS: code 50 unless the store can be written and every range set has an address left."""
    if not ipam.ranges:
        raise CniError(PLUGIN_NOT_AVAILABLE, details=ipam.no_ranges or "ipam: no ranges")
    try:
        free = status(network, ipam, opener)
    except CniError as e:
        if e.code != IPAM_STORE:
            raise
        raise CniError(PLUGIN_NOT_AVAILABLE, details=e.details) from None
    for i, n in enumerate(free):
        if n == 0:
            ranges = ", ".join(f"{r.range_start}-{r.range_end}" for r in ipam.ranges[i])
            raise CniError(PLUGIN_NOT_AVAILABLE, details=f"ipam.ranges[{i}] ({ranges}) has no address left")
