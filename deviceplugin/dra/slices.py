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
a value the device does not have. ``resource.k8s.io`` v1beta1 nests a device's attributes under ``basic``; v1 (and
v1beta2) has them on the device itself: :func:`encode_device` and :func:`observed_devices` are the only places that
know.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_DEVICES = 128  # per slice (ResourceSliceMaxDevices)
MAX_ATTRIBUTES = 32  # attributes and capacities per device
MAX_STRING = 64  # an attribute's string value

AttrValue = str | int | bool


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


def encode_device(d: SliceDevice, version: str) -> dict[str, Any]:
    attrs = {k: _value(v) for k, v in d.attributes}
    if version == "v1beta1":
        return {"name": d.name, "basic": {"attributes": attrs}}
    return {"name": d.name, "attributes": attrs}


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
) -> dict[str, Any]:
    """A ResourceSlice of this node's pool (a new one, with a generated name, when ``name`` is empty)."""
    meta: dict[str, Any] = {"labels": {"app.kubernetes.io/managed-by": "nodeplug"}}
    if name:
        meta["name"] = name
    else:
        meta["generateName"] = f"{node}-{driver}-"[-200:].lstrip("-.")
    if resource_version:
        meta["resourceVersion"] = resource_version
    if node_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "devices": [encode_device(d, version) for d in devices],
        },
    }


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


def observed_devices(devices: object, version: str) -> tuple[SliceDevice, ...] | None:
    if not isinstance(devices, list):
        return None
    out = []
    for d in devices:
        if not isinstance(d, Mapping) or not isinstance(d.get("name"), str):
            return None
        holder = d.get("basic") if version == "v1beta1" else d
        attrs = holder.get("attributes") if isinstance(holder, Mapping) else None
        if attrs is None:
            attrs = {}
        if not isinstance(attrs, Mapping):
            return None
        pairs = []
        for k, v in attrs.items():
            value = _attr(v)
            if not isinstance(k, str) or value is None:
                return None
            pairs.append((k, value))
        out.append(SliceDevice(d["name"], tuple(sorted(pairs))))
    return tuple(out)


def observe(obj: Mapping[str, Any], *, version: str, driver: str, node: str) -> Observed | None:
    """The slice as published, or None when it is not this driver's slice for this node's pool."""
    meta, spec = obj.get("metadata"), obj.get("spec")
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return None
    if spec.get("driver") != driver or spec.get("nodeName") != node:
        return None
    name, rv = meta.get("name"), meta.get("resourceVersion")
    if not isinstance(name, str) or not name:
        return None
    pool = spec.get("pool")
    gen = pool.get("generation") if isinstance(pool, Mapping) else None
    count = pool.get("resourceSliceCount") if isinstance(pool, Mapping) else None
    good_pool = isinstance(pool, Mapping) and pool.get("name") == node
    return Observed(
        name=name,
        resource_version=rv if isinstance(rv, str) else "",
        generation=gen if isinstance(gen, int) and not isinstance(gen, bool) else -1,
        count=count if isinstance(count, int) and not isinstance(count, bool) else -1,
        devices=observed_devices(spec.get("devices"), version) if good_pool else None,
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
