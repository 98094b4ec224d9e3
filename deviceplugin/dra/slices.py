"""This node's ResourceSlices: what should be published, and whether what is published is that. Pure.

One pool per node, named after the node, holding every device offered through DRA that is present, healthy and not
in use through the device plugin. A pool of more than :data:`MAX_DEVICES` devices is split over several slices
(``resourceSliceCount``), all carrying the pool's generation, which is bumped on every change so the scheduler
never mixes two states of the pool.

Attributes a DeviceClass or a claim selects on (unqualified names live in the driver's domain, so CEL reads them
as ``device.attributes["devices.nodeplug.io"].resource``):

- ``resource`` (string): the configured resource name (``fuse``);
- ``kind`` (string): ``node`` (a device-node glob), ``pci`` or ``usb``;
- ``path`` (string): the device's first node (``/dev/fuse``);
- ``numaNode`` (int), when known;
- PCI: ``pciAddress``, ``vendor``, ``product`` (4 hex digits each); USB: ``usbPath`` (the sysfs port name),
  ``vendor``, ``product`` and ``serial``.

A value the API would refuse (a string over 64 characters) is left out rather than cut, so a selector never matches
a value the device does not have. Slices are lightkube's typed models of ``resource.k8s.io`` v1beta1 or v1 (written
by :func:`slice_object`, read back by :func:`observe`); v1beta1 nests a device's attributes under ``basic``, v1 (and
v1beta2) has them on the device itself: :func:`encode_device` and :func:`observed_devices` are the only places that
know. The API types attributes as a free map: their values are read defensively.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from lightkube.models import resource_v1 as m1
from lightkube.models import resource_v1beta1 as mb
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources import resource_v1, resource_v1beta1

MAX_DEVICES = 128  # per slice (ResourceSliceMaxDevices)
MAX_ATTRIBUTES = 32  # attributes and capacities per device
MAX_STRING = 64  # an attribute's string value

AttrValue = str | int | bool
Slice: TypeAlias = resource_v1.ResourceSlice | resource_v1beta1.ResourceSlice


@dataclass(frozen=True)
class SliceDevice:
    """One device as published: its name in the pool and its attributes."""

    name: str
    attributes: tuple[tuple[str, AttrValue], ...]


def attributes(
    resource: str,
    kind: str,
    path: str,
    numa: int | None,
    address: str = "",
    vendor: str = "",
    product: str = "",
    serial: str = "",
) -> tuple[tuple[str, AttrValue], ...]:
    attrs: dict[str, AttrValue] = {"resource": resource, "kind": kind}
    if path:
        attrs["path"] = path
    if numa is not None:
        attrs["numaNode"] = numa
    if kind == "pci" and address:
        attrs["pciAddress"] = address
    if kind == "usb" and address:
        attrs["usbPath"] = address
    if vendor:
        attrs["vendor"] = vendor
    if product:
        attrs["product"] = product
    if serial:
        attrs["serial"] = serial
    kept = {k: v for k, v in attrs.items() if not (isinstance(v, str) and len(v) > MAX_STRING)}
    return tuple(sorted(kept.items())[:MAX_ATTRIBUTES])


def chunks(devices: Sequence[SliceDevice]) -> list[tuple[SliceDevice, ...]]:
    ordered = sorted(devices, key=lambda d: d.name)
    return [tuple(ordered[i : i + MAX_DEVICES]) for i in range(0, len(ordered), MAX_DEVICES)]


def _value(v: AttrValue) -> dict[str, AttrValue]:
    if isinstance(v, bool):
        return {"bool": v}
    if isinstance(v, int):
        return {"int": v}
    return {"string": v}


def encode_device(d: SliceDevice, version: str) -> m1.Device | mb.Device:
    attrs = {k: _value(v) for k, v in d.attributes}
    if version == "v1beta1":
        return mb.Device(name=d.name, basic=mb.BasicDevice(attributes=attrs))
    return m1.Device(name=d.name, attributes=attrs)


def slice_object(
    *,
    version: str,
    driver: str,
    node: str,
    node_uid: str,
    generation: int,
    count: int,
    devices: Sequence[SliceDevice],
    name: str = "",
    resource_version: str = "",
) -> Slice:
    """A ResourceSlice of this node's pool (a new one, with a generated name, when ``name`` is empty)."""
    meta = ObjectMeta(
        labels={"app.kubernetes.io/managed-by": "nodeplug"},
        name=name or None,
        generateName=None if name else f"{node}-{driver}-"[-200:].lstrip("-."),
        resourceVersion=resource_version or None,
        ownerReferences=[OwnerReference(apiVersion="v1", kind="Node", name=node, uid=node_uid, controller=True)]
        if node_uid
        else None,
    )
    api = f"resource.k8s.io/{version}"
    if version == "v1beta1":
        pool_b = mb.ResourcePool(name=node, generation=generation, resourceSliceCount=count)
        devs_b = [mb.Device(name=d.name, basic=mb.BasicDevice(attributes=_attrs(d))) for d in devices]
        spec_b = mb.ResourceSliceSpec(driver=driver, nodeName=node, pool=pool_b, devices=devs_b)
        return resource_v1beta1.ResourceSlice(apiVersion=api, kind="ResourceSlice", metadata=meta, spec=spec_b)
    pool = m1.ResourcePool(name=node, generation=generation, resourceSliceCount=count)
    devs = [m1.Device(name=d.name, attributes=_attrs(d)) for d in devices]
    spec = m1.ResourceSliceSpec(driver=driver, nodeName=node, pool=pool, devices=devs)
    return resource_v1.ResourceSlice(apiVersion=api, kind="ResourceSlice", metadata=meta, spec=spec)


def _attrs(d: SliceDevice) -> dict[str, dict[str, AttrValue]]:
    return {k: _value(v) for k, v in d.attributes}


@dataclass(frozen=True)
class Observed:
    """What a published slice says, read defensively (anything odd reads as "does not match")."""

    name: str
    resource_version: str
    generation: int
    count: int
    devices: tuple[SliceDevice, ...] | None  # None: unreadable, to be rewritten


def _attr(v: object) -> AttrValue | None:
    if not isinstance(v, Mapping) or len(v) != 1:
        return None
    ((kind, value),) = v.items()
    if kind == "string" and isinstance(value, str):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "bool" and isinstance(value, bool):
        return value
    return None


def observed_devices(devices: Sequence[m1.Device | mb.Device] | None, version: str) -> tuple[SliceDevice, ...] | None:
    out = []
    for d in devices or ():
        if isinstance(d, mb.Device) != (version == "v1beta1"):
            return None  # a device of the other version's shape
        attrs = (d.basic.attributes if d.basic is not None else None) if isinstance(d, mb.Device) else d.attributes
        pairs = []
        for k, v in (attrs or {}).items():
            value = _attr(v)
            if not isinstance(k, str) or value is None:
                return None
            pairs.append((k, value))
        out.append(SliceDevice(d.name, tuple(sorted(pairs))))
    return tuple(out)


def observe(obj: Slice, *, version: str, driver: str, node: str) -> Observed | None:
    """The slice as published, or None when it is not this driver's slice for this node's pool."""
    meta, spec = obj.metadata, obj.spec
    if meta is None or spec.driver != driver or spec.nodeName != node or not meta.name:
        return None
    good_pool = spec.pool.name == node
    return Observed(
        name=meta.name,
        resource_version=meta.resourceVersion or "",
        generation=spec.pool.generation,
        count=spec.pool.resourceSliceCount,
        devices=observed_devices(spec.devices, version) if good_pool else None,
    )


def up_to_date(observed: Sequence[Observed], desired: Sequence[tuple[SliceDevice, ...]]) -> bool:
    """The published slices are exactly the desired ones, of one generation."""
    if len(observed) != len(desired):
        return False
    if not desired:
        return True
    gens = {o.generation for o in observed}
    if len(gens) != 1 or min(gens) < 0 or any(o.count != len(desired) for o in observed):
        return False
    return Counter(o.devices for o in observed) == Counter(desired)
