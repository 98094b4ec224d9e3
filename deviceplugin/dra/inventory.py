"""One inventory, two ways to hand a device out: the device plugin and DRA.

Discovery and health stay where they are (one :class:`deviceplugin.resource.ResourceRuntime` per resource); this
module is the view the DRA side takes of them, and the bookkeeping that keeps each *replica* of a resource offered
``both`` ways with one side at a time.

A resource with ``replicas: N`` lets N pods share each physical device; the device plugin lists N IDs per device
(``<id>::0`` .. ``<id>::<N-1>``). DRA offers the same N replicas as N devices of the pool (``fuse-fuse-0`` ..
``fuse-fuse-15`` for /dev/fuse with 16; a resource with one replica keeps the plain name ``fuse-fuse``), each with
the physical device's attributes, so as many pods hold a claim for it at once as the device plugin allows, and the
two sides together never hand out more than N. The replica is the unit both sides hold:

- **DRA -> device plugin**: a replica prepared for a claim is listed unhealthy to kubelet's device manager (reason
  "prepared for DRA claim ns/name", :meth:`ResourceRuntime.set_held`) from the moment the claim is recorded until it
  is unprepared, so ListAndWatch never offers it and Allocate refuses it; the device's other replicas stay offered;
- **device plugin -> DRA**: a replica Allocate handed out is withheld from the ResourceSlice at once (the scheduler
  stops choosing it) and refused by NodePrepareResources, until kubelet's pod-resources API no longer lists it for
  any pod (polled every :data:`POLL_SECONDS` while anything is held; never released when that API cannot be read).
  After an agent restart the holds are read back from the pod-resources API.

With one replica (a device that is not shared) this is one device, one side. Races that remain (each ends in a
refusal, never in one replica handed out twice): a claim the scheduler allocated from a slice published just before
a device-plugin Allocate fails to prepare and kubelet retries until the replica is free (the pod waits in
ContainerCreating); a pod the device manager admitted with a view older than a claim's preparation fails admission
(Allocate answers FAILED_PRECONDITION). Prepare and Allocate run in one event loop and check-and-record without
yielding, so they never both take a replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from deviceplugin.dra import names, slices
from deviceplugin.dra.prepare import Offered
from deviceplugin.resource import ResourceRuntime
from deviceplugin.state import Listed, replica_ids

POLL_SECONDS = 2.0
GRACE_SECONDS = 5.0  # an allocation younger than this may not be listed by kubelet yet


@dataclass
class DevicePluginHolds:
    """Replicas handed out through the device plugin: (resource, replica id) -> monotonic time of the Allocate."""

    held: dict[tuple[str, str], float] = field(default_factory=dict)

    def allocated(self, resource: str, entries: list[Listed], now: float) -> bool:
        new = False
        for e in entries:
            key = (resource, e.id)
            new |= key not in self.held
            self.held[key] = now
        return new

    def reconcile(self, in_use: Mapping[str, set[str]], resource_names: Mapping[str, str], now: float) -> bool:
        """Apply what kubelet lists (resource name -> IDs): release holds no pod uses, add ones found in use.
        ``resource_names`` maps our resource names to kubelet's (``fuse`` -> ``nodeplug.io/fuse``)."""
        changed = False
        using = {(res, i) for res, full in resource_names.items() for i in in_use.get(full, set())}
        for key in using - self.held.keys():
            self.held[key] = now - GRACE_SECONDS
            changed = True
        for key, since in list(self.held.items()):
            if key not in using and now - since >= GRACE_SECONDS:
                del self.held[key]
                changed = True
        return changed


class InventoryView:
    """The DRA side's view of the device plugin's resources (see the module docstring)."""

    def __init__(self, runtimes: Callable[[], Mapping[str, ResourceRuntime]]) -> None:
        self.runtimes = runtimes
        self.holds = DevicePluginHolds()
        self._cache: dict[str, Offered] | None = None

    def invalidate(self) -> None:
        self._cache = None

    def snapshot(self) -> dict[str, Offered]:
        """Every replica of every present device of every resource offered through DRA, by its name in the pool."""
        if self._cache is not None:
            return self._cache
        offered = [
            (rt, dev, rid)
            for rt in self.runtimes().values()
            if rt.res.via_dra
            for dev in rt.table.devices()
            for rid in replica_ids(dev.id, rt.res.replicas)
        ]
        named = names.device_names([(rt.res.name, rid) for rt, _, rid in offered])
        out: dict[str, Offered] = {}
        for rt, dev, rid in offered:
            name = named[(rt.res.name, rid)]
            out[name] = Offered(name, rt.res, dev, rt.table.reason(dev.id), replica=rid)
        self._cache = out
        return out

    def offered(self, name: str) -> Offered | None:
        return self.snapshot().get(name)

    def in_use_elsewhere(self, resource: str, replica: str) -> str:
        if (resource, replica) in self.holds.held:
            return f"in use through the device plugin (nodeplug.io/{resource})"
        return ""

    def desired(self) -> list[slices.SliceDevice]:
        out = []
        for o in self.snapshot().values():
            if o.problem or self.in_use_elsewhere(o.resource.name, o.unit):
                continue
            d = o.device
            out.append(
                slices.SliceDevice(
                    o.name,
                    slices.attributes(
                        o.resource.name,
                        _kind_of(o),
                        d.path,
                        d.numa,
                        d.address,
                        d.vendor,
                        d.product,
                        d.serial,
                    ),
                )
            )
        return out

    def shared(self) -> dict[str, str]:
        """Resources offered both ways: our name -> kubelet's resource name."""
        return {n: rt.res.resource_name for n, rt in self.runtimes().items() if rt.res.offer == "both"}

    def allocated(self, resource: str, entries: list[Listed]) -> bool:
        rt = self.runtimes().get(resource)
        if rt is None or rt.res.offer != "both":
            return False
        return self.holds.allocated(resource, entries, time.monotonic())


def _kind_of(o: Offered) -> str:
    res = o.resource
    if o.device.address and res.pci and ":" in o.device.address:
        return "pci"
    if o.device.address and res.usb:
        return "usb"
    return "node"
