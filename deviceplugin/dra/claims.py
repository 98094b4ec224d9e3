"""A ResourceClaim as the API server sent it, reduced to what this driver must prepare. Pure.

The claim arrives as lightkube's model of ``resource.k8s.io`` v1beta1 or v1 (the two carry these fields in the same
places), decoded and checked against the API's schema at the edge: every field has its type. Its values are still
hostile until checked: :func:`parse_claim` accepts only a claim whose namespace, name and UID are the ones kubelet
asked for (a claim deleted and made again under the same name has another UID: preparing it would hand the devices
to the wrong pods), that is allocated, and whose results for this driver name well-formed pools, devices and
requests, each device once. Results of other drivers are skipped (one claim may span drivers); opaque configuration
addressed to this driver is refused, since it takes none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from deviceplugin.dra.names import NameError_, check_device, check_pool, check_request

if TYPE_CHECKING:  # types only: lightkube is loaded by whoever reads claims from the API
    from lightkube.resources import resource_v1, resource_v1beta1

Claim: TypeAlias = "resource_v1.ResourceClaim | resource_v1beta1.ResourceClaim"

MAX_RESULTS = 256


# What this module reads of a claim's allocation, the same in v1beta1 and v1 (read-only, so either version's model is
# one of these).
class _Result(Protocol):
    @property
    def driver(self) -> str: ...
    @property
    def request(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def adminAccess(self) -> bool | None: ...


class _Opaque(Protocol):
    @property
    def driver(self) -> str: ...


class _Config(Protocol):
    @property
    def opaque(
        self,
    ) -> _Opaque | None: ...  # the API allows 32 per claim; anything past this is not a claim the API server wrote


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


def parse_claim(claim: Claim, *, namespace: str, name: str, uid: str, driver: str) -> ClaimAllocation:
    """This driver's share of the allocation of the ResourceClaim ``namespace/name`` with ``uid``; every
    :class:`ClaimError` names the claim."""
    ref = f"ResourceClaim {namespace}/{name}"
    meta = claim.metadata
    for key, got, want in (
        ("namespace", meta and meta.namespace, namespace),
        ("name", meta and meta.name, name),
    ):
        if got != want:
            raise ClaimError(f"{ref}: metadata.{key} is {got!r}, not {want!r}")
    got_uid = meta.uid if meta is not None else None
    if got_uid != uid:
        raise ClaimError(
            f"{ref}: has UID {got_uid!r}, kubelet asked for {uid!r} (the claim was deleted and made again)"
        )
    allocation = claim.status.allocation if claim.status is not None else None
    if allocation is None:
        raise ClaimError(f"{ref}: not allocated (status.allocation is empty)")
    devices = allocation.devices
    results: Sequence[_Result] = (devices.results if devices is not None else None) or []
    if len(results) > MAX_RESULTS:
        raise ClaimError(f"{ref}: status.allocation.devices.results has {len(results)} entries, at most {MAX_RESULTS}")
    out: list[AllocatedDevice] = []
    seen: set[tuple[str, str]] = set()
    for i, r in enumerate(results):
        where = f"status.allocation.devices.results[{i}]"
        if r.driver != driver:
            continue
        try:
            request = check_request(r.request, f"{where}.request")
            pool = check_pool(r.pool, f"{where}.pool")
            device = check_device(r.device, f"{where}.device")
        except NameError_ as e:
            raise ClaimError(f"{ref}: {e}") from None
        admin = bool(r.adminAccess)
        if (pool, device) in seen and not admin:
            raise ClaimError(f"{ref}: {where}: device {pool}/{device} is allocated twice")
        seen.add((pool, device))
        out.append(AllocatedDevice(request, pool, device, admin))
    configs: Sequence[_Config] = (devices.config if devices is not None else None) or []
    for i, c in enumerate(configs):
        if c.opaque is not None and c.opaque.driver == driver:
            raise ClaimError(
                f"{ref}: status.allocation.devices.config[{i}]: {driver} takes no opaque configuration; remove it "
                "from the claim or its DeviceClass"
            )
    return ClaimAllocation(namespace, name, uid, tuple(out))
