"""One inventory, two ways to hand a device out: the device plugin and DRA.

Discovery and health stay where they are (one :class:`deviceplugin.resource.ResourceRuntime` per resource); this
module is the view the DRA side takes of them, and the bookkeeping that keeps each physical device of a resource
offered ``both`` ways with one side at a time:

- **DRA -> device plugin**: a device prepared for a claim is listed unhealthy to kubelet's device manager (reason
  "prepared for DRA claim ns/name", :meth:`ResourceRuntime.set_held`) from the moment the claim is recorded until it
  is unprepared, so ListAndWatch never offers it and Allocate refuses it;
- **device plugin -> DRA**: a device Allocate handed out is withheld from the ResourceSlice at once (the scheduler
  stops choosing it) and refused by NodePrepareResources, until kubelet's pod-resources API no longer lists it for
  any pod (polled every :data:`POLL_SECONDS` while anything is held; never released when that API cannot be read).
  After an agent restart the holds are read back from the pod-resources API.

Races that remain (each ends in a refusal, never in one device handed out twice): a claim the scheduler allocated
from a slice published just before a device-plugin Allocate fails to prepare and kubelet retries until the device
is free (the pod waits in ContainerCreating); a pod the device manager admitted with a view older than a claim's
preparation fails admission (Allocate answers FAILED_PRECONDITION). Prepare and Allocate run in one event loop and
check-and-record without yielding, so they never both take a device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from deviceplugin.dra import names, slices
from deviceplugin.dra.prepare import Offered
from deviceplugin.resource import ResourceRuntime
from deviceplugin.state import Listed, physical_id

POLL_SECONDS = 2.0
GRACE_SECONDS = 5.0  # an allocation younger than this may not be listed by kubelet yet


@dataclass
class DevicePluginHolds:
    """Physical devices handed out through the device plugin: (resource, device id) -> monotonic time."""

    held: dict[tuple[str, str], float] = field(default_factory=dict)

    def allocated(self, resource: str, entries: list[Listed], now: float) -> bool:
        new = False
        for e in entries:
            key = (resource, physical_id(e.id))
            new |= key not in self.held
            self.held[key] = now
        return new

    def reconcile(self, in_use: Mapping[str, set[str]], resource_names: Mapping[str, str], now: float) -> bool:
        """Apply what kubelet lists (resource name -> IDs): release holds no pod uses, add ones found in use.
        ``resource_names`` maps our resource names to kubelet's (``fuse`` -> ``nodeplug.io/fuse``)."""
        changed = False
        using = {(res, physical_id(i)) for res, full in resource_names.items() for i in in_use.get(full, set())}
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
        """Every present device of every resource offered through DRA, by its name in the pool."""
        if self._cache is not None:
            return self._cache
        pairs = [
            (rt.res.name, dev.id) for rt in self.runtimes().values() if rt.res.via_dra for dev in rt.table.devices()
        ]
        named = names.device_names(pairs)
        out: dict[str, Offered] = {}
        for rt in self.runtimes().values():
            if not rt.res.via_dra:
                continue
            for dev in rt.table.devices():
                name = named[(rt.res.name, dev.id)]
                out[name] = Offered(name, rt.res, dev, rt.table.reason(dev.id))
        self._cache = out
        return out

    def offered(self, name: str) -> Offered | None:
        return self.snapshot().get(name)

    def in_use_elsewhere(self, resource: str, device_id: str) -> str:
        if (resource, device_id) in self.holds.held:
            return f"in use through the device plugin (nodeplug.io/{resource})"
        return ""

    def desired(self) -> list[slices.SliceDevice]:
        out = []
        for o in self.snapshot().values():
            if o.problem or self.in_use_elsewhere(o.resource.name, o.device.id):
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
