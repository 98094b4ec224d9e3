"""A ResourceClaim as the API server sent it, reduced to what this driver must prepare. Pure.

The object is hostile until checked: :func:`parse_claim` accepts only a claim whose namespace, name and UID are the
ones kubelet asked for (a claim deleted and made again under the same name has another UID: preparing it would
hand the devices to the wrong pods), that is allocated, and whose results for this driver name well-formed pools,
devices and requests, each device once. Results of other drivers are skipped (one claim may span drivers); opaque
configuration addressed to this driver is refused, since it takes none. ``resource.k8s.io`` v1beta1 and v1 carry
these fields in the same places.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deviceplugin.dra.names import NameError_, check_device, check_pool, check_request

MAX_RESULTS = 256  # the API allows 32 per claim; anything past this is not a claim the API server wrote


class ClaimError(Exception):
    """The claim cannot be prepared; the message says why, naming the claim."""


@dataclass(frozen=True)
class AllocatedDevice:
    request: str
    pool: str
    device: str
    admin_access: bool = False


@dataclass(frozen=True)
class ClaimAllocation:
    namespace: str
    name: str
    uid: str
    devices: tuple[AllocatedDevice, ...]


def _get(obj: Mapping[str, Any], key: str, kind: type, where: str, required: bool = True) -> Any:
    v = obj.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise ClaimError(f"{where}.{key}: expected {kind.__name__}, got {type(v).__name__}")
    return v


def parse_claim(obj: object, *, namespace: str, name: str, uid: str, driver: str) -> ClaimAllocation:
    """This driver's share of the allocation of the ResourceClaim ``namespace/name`` with ``uid``; every
    :class:`ClaimError` names the claim."""
    ref = f"ResourceClaim {namespace}/{name}"
    try:
        return _parse(obj, ref, namespace=namespace, name=name, uid=uid, driver=driver)
    except ClaimError as e:
        if str(e).startswith(ref):
            raise
        raise ClaimError(f"{ref}: {e}") from None


def _parse(obj: object, ref: str, *, namespace: str, name: str, uid: str, driver: str) -> ClaimAllocation:
    if not isinstance(obj, Mapping):
        raise ClaimError(f"{ref}: expected an object, got {type(obj).__name__}")
    meta = _get(obj, "metadata", Mapping, "claim")
    for key, want in (("namespace", namespace), ("name", name)):
        got = meta.get(key)
        if got != want:
            raise ClaimError(f"{ref}: metadata.{key} is {got!r}, not {want!r}")
    got_uid = meta.get("uid")
    if got_uid != uid:
        raise ClaimError(
            f"{ref}: has UID {got_uid!r}, kubelet asked for {uid!r} (the claim was deleted and made again)"
        )
    status = _get(obj, "status", Mapping, "claim", required=False) or {}
    allocation = status.get("allocation")
    if allocation is None:
        raise ClaimError(f"{ref}: not allocated (status.allocation is empty)")
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"{ref}: status.allocation: expected an object, got {type(allocation).__name__}")
    devices = _get(allocation, "devices", Mapping, "status.allocation", required=False) or {}
    results = _get(devices, "results", list, "status.allocation.devices", required=False) or []
    if len(results) > MAX_RESULTS:
        raise ClaimError(f"{ref}: status.allocation.devices.results has {len(results)} entries, at most {MAX_RESULTS}")
    out: list[AllocatedDevice] = []
    seen: set[tuple[str, str]] = set()
    for i, r in enumerate(results):
        where = f"status.allocation.devices.results[{i}]"
        if not isinstance(r, Mapping):
            raise ClaimError(f"{ref}: {where}: expected an object, got {type(r).__name__}")
        if _get(r, "driver", str, where) != driver:
            continue
        try:
            request = check_request(r.get("request"), f"{where}.request")
            pool = check_pool(r.get("pool"), f"{where}.pool")
            device = check_device(r.get("device"), f"{where}.device")
        except NameError_ as e:
            raise ClaimError(f"{ref}: {e}") from None
        admin = _get(r, "adminAccess", bool, where, required=False) or False
        if (pool, device) in seen and not admin:
            raise ClaimError(f"{ref}: {where}: device {pool}/{device} is allocated twice")
        seen.add((pool, device))
        out.append(AllocatedDevice(request, pool, device, admin))
    configs = _get(devices, "config", list, "status.allocation.devices", required=False) or []
    for i, c in enumerate(configs):
        opaque = c.get("opaque") if isinstance(c, Mapping) else None
        if isinstance(opaque, Mapping) and opaque.get("driver") == driver:
            raise ClaimError(
                f"{ref}: status.allocation.devices.config[{i}]: {driver} takes no opaque configuration; remove it "
                "from the claim or its DeviceClass"
            )
    return ClaimAllocation(namespace, name, uid, tuple(out))
