"""Discovery: which devices of a resource exist on this node, read from ``/dev`` and ``/sys`` under a host root.

Three kinds of matcher, all resolved against ``host_root`` so tests build a fake tree (real ``mknod`` nodes, a fake
sysfs) in a temporary directory:

- device-node globs (``/dev/fuse``, ``/dev/ttyUSB*``): one device per matching character or block node, its ID the
  path below ``/dev`` with ``/`` turned into ``-`` (``fuse``, ``net-tun``, ``dri-renderD128``); NUMA from
  ``/sys/dev/{char,block}/MAJ:MIN``;
- PCI (``/sys/bus/pci/devices/*/{vendor,device,class,numa_node}``): one device per function, its ID the PCI address,
  its nodes the configured templates (``/dev/vfio/{iommu_group}``);
- USB (``/sys/bus/usb/devices/*/{idVendor,idProduct,serial}``): one device per USB device, its ID the sysfs name
  (``1-1.2``, stable per port), its nodes every ``dev`` below it in sysfs (``tty/ttyUSB0``, ``bus/usb/001/004``),
  named by the ``DEVNAME`` in its ``uevent`` or else ``/dev/char/MAJ:MIN``.

Paths in a :class:`Device` are as the host sees them (``/dev/fuse``), never prefixed with ``host_root``: they go to
kubelet and the container runtime. Discovery only reads files; it never raises for a missing or odd entry, it
reports a problem line instead.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from deviceplugin.config import PciMatch, Resource, UsbMatch


@dataclass(frozen=True)
class DeviceNode:
    host_path: str
    container_path: str


@dataclass(frozen=True)
class Device:
    """One physical device of a resource (before replicas)."""

    id: str
    nodes: tuple[DeviceNode, ...]
    numa: int | None = None
    address: str = ""  # PCI address or USB sysfs name; "" for a device-node glob
    missing: tuple[str, ...] = ()  # nodes (host paths) that do not exist: the device is unhealthy
    vendor: str = ""  # PCI vendor / USB idVendor (4 hex digits); "" for a device-node glob
    product: str = ""  # PCI device / USB idProduct
    serial: str = ""  # USB serial, when the device has one

    @property
    def path(self) -> str:
        return self.nodes[0].host_path if self.nodes else ""


@dataclass
class Discovery:
    devices: list[Device] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _under(host_root: str, path: str) -> str:
    return os.path.join(host_root, path.lstrip("/")) if host_root != "/" else path


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _hex(text: str | None) -> str | None:
    if text is None:
        return None
    return text.lower().removeprefix("0x")


def _numa_from(host_root: str, sys_dir: str) -> int | None:
    """The NUMA node of a sysfs device directory: its own ``numa_node`` or the nearest ancestor's."""
    sys_top = os.path.realpath(_under(host_root, "/sys"))
    try:
        d = os.path.realpath(sys_dir)
    except OSError:
        return None
    while d.startswith(sys_top + os.sep):
        text = _read(os.path.join(d, "numa_node"))
        if text is not None:
            try:
                n = int(text)
            except ValueError:
                return None
            return n if n >= 0 else None
        d = os.path.dirname(d)
    return None


@functools.lru_cache(maxsize=8192)
def natural_key(s: str) -> tuple[tuple[int, int | str], ...]:
    """Sort ``ttyUSB2`` before ``ttyUSB10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", s) if p)


def _exists(host_root: str, path: str) -> bool:
    return os.path.exists(_under(host_root, path))


def _finish(
    host_root: str,
    dev_id: str,
    nodes: list[str],
    extra: list[str],
    numa: int | None,
    address: str,
    present: dict[str, bool],
    vendor: str = "",
    product: str = "",
    serial: str = "",
) -> Device:
    """A device with its nodes; ``present`` caches node existence for one scan (nodes shared by many devices)."""
    paths = list(dict.fromkeys([*nodes, *extra]))
    for p in paths:
        if p not in present:
            present[p] = _exists(host_root, p)
    missing = tuple(p for p in paths if not present[p])
    return Device(
        id=dev_id,
        nodes=tuple(DeviceNode(p, p) for p in paths),
        numa=numa,
        address=address,
        missing=missing,
        vendor=vendor,
        product=product,
        serial=serial,
    )


def glob_id(path: str) -> str:
    return path.removeprefix("/dev/").strip("/").replace("/", "-")


def _glob(
    host_root: str, pattern: str, res: Resource, out: Discovery, seen: set[str], present: dict[str, bool]
) -> None:
    strip = len(host_root.rstrip("/"))
    numa_of: dict[tuple[str, int], int | None] = {}
    for found in sorted(glob.glob(_under(host_root, pattern))):
        host_path = found[strip:]
        try:
            st = os.stat(found)
        except OSError:
            continue  # dangling symlink: not a device (yet)
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            continue
        dev_id = glob_id(host_path)
        if dev_id in seen:
            continue
        seen.add(dev_id)
        present[host_path] = True
        kind = "char" if stat.S_ISCHR(st.st_mode) else "block"
        key = (kind, st.st_rdev)
        if key not in numa_of:
            sys_dir = _under(host_root, f"/sys/dev/{kind}/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
            numa_of[key] = _numa_from(host_root, os.path.join(sys_dir, "device")) if os.path.exists(sys_dir) else None
        out.devices.append(_finish(host_root, dev_id, [host_path], res.nodes, numa_of[key], "", present))


def _pci(
    host_root: str, matchers: list[PciMatch], res: Resource, out: Discovery, seen: set[str], present: dict[str, bool]
) -> None:
    top = _under(host_root, "/sys/bus/pci/devices")
    try:
        names = sorted(os.listdir(top))
    except OSError:
        return
    for addr in names:
        d = os.path.join(top, addr)
        vendor, device, klass = (_hex(_read(os.path.join(d, f))) for f in ("vendor", "device", "class"))
        for m in matchers:
            if m.vendor is not None and vendor != m.vendor:
                continue
            if m.device is not None and device != m.device:
                continue
            if m.class_prefix is not None and not (klass or "").startswith(m.class_prefix):
                continue
            if addr in seen:
                break
            fields = {"address": addr, "iommu_group": ""}
            with contextlib.suppress(OSError):
                fields["iommu_group"] = os.path.basename(os.readlink(os.path.join(d, "iommu_group")))
            nodes: list[str] = []
            for tmpl in m.nodes:
                if "{iommu_group}" in tmpl and not fields["iommu_group"]:
                    out.problems.append(f"PCI device {addr}: no iommu_group (bind it to vfio-pci), skipped")
                    break
                nodes.append(tmpl.format(**fields))
            else:
                seen.add(addr)
                numa = _numa_from(host_root, d)
                out.devices.append(
                    _finish(host_root, addr, nodes, res.nodes, numa, addr, present, vendor or "", device or "")
                )
            break


def _usb_nodes(host_root: str, dev_dir: str) -> list[str]:
    nodes: list[str] = []
    real = os.path.realpath(dev_dir)
    for cur, dirs, files in os.walk(real):
        if cur != real and "idVendor" in files:
            dirs[:] = []  # a child USB device (behind a hub) is a device of its own
            continue
        dirs.sort()
        if "dev" not in files:
            continue
        devname = None
        for line in (_read(os.path.join(cur, "uevent")) or "").splitlines():
            if line.startswith("DEVNAME="):
                devname = line.removeprefix("DEVNAME=").strip()
        if devname:
            nodes.append("/dev/" + devname.removeprefix("/dev/"))
            continue
        majmin = _read(os.path.join(cur, "dev"))
        if majmin:
            kind = "block" if "/block/" in cur else "char"
            nodes.append(f"/dev/{kind}/{majmin}")
    return nodes


def _usb(
    host_root: str, matchers: list[UsbMatch], res: Resource, out: Discovery, seen: set[str], present: dict[str, bool]
) -> None:
    top = _under(host_root, "/sys/bus/usb/devices")
    try:
        names = sorted(os.listdir(top), key=natural_key)
    except OSError:
        return
    for name in names:
        d = os.path.join(top, name)
        vendor = _hex(_read(os.path.join(d, "idVendor")))
        if vendor is None:
            continue  # an interface, not a device
        product = _hex(_read(os.path.join(d, "idProduct")))
        serial = _read(os.path.join(d, "serial"))
        for m in matchers:
            if vendor != m.vendor or product != m.product or (m.serial is not None and serial != m.serial):
                continue
            if name in seen:
                break
            nodes = _usb_nodes(host_root, d)
            if not nodes:
                out.problems.append(f"USB device {name} ({vendor}:{product}): no device nodes in sysfs, skipped")
                break
            seen.add(name)
            numa = _numa_from(host_root, d)
            out.devices.append(
                _finish(host_root, name, nodes, res.nodes, numa, name, present, vendor, product or "", serial or "")
            )
            break


def discover(res: Resource, host_root: str) -> Discovery:
    """Every device of ``res`` present under ``host_root``, sorted by ID."""
    out = Discovery()
    seen: set[str] = set()
    present: dict[str, bool] = {}
    for pattern in res.devices:
        _glob(host_root, pattern, res, out, seen, present)
    if res.pci:
        _pci(host_root, res.pci, res, out, seen, present)
    if res.usb:
        _usb(host_root, res.usb, res, out, seen, present)
    out.devices.sort(key=lambda d: natural_key(d.id))
    return out


def watch_dirs(res: Resource, host_root: str, devices: list[Device]) -> set[str]:
    """Directories (under ``host_root``) whose changes may change this resource's devices.

    For each glob, every existing directory matching its directory part, or else the deepest existing ancestor of
    its literal prefix (so a directory that appears later is noticed); the directories of every device node; the
    sysfs bus directories for PCI/USB (inotify on real sysfs is silent, uevents cover it; on a fake tree it works).
    """
    out: set[str] = set()

    def ancestor(path: str) -> None:
        p = Path(_under(host_root, path))
        while not p.is_dir() and p != p.parent:
            p = p.parent
        out.add(str(p))

    for pattern in [*res.devices, *res.nodes]:
        dir_part = os.path.dirname(pattern)
        matches = [m for m in glob.glob(_under(host_root, dir_part)) if os.path.isdir(m)]
        out.update(matches)
        literal = re.split(r"[*?\[]", dir_part, maxsplit=1)[0]
        ancestor(literal if literal.endswith("/") or literal == dir_part else os.path.dirname(literal))
    for parent in {os.path.dirname(node.host_path) for dev in devices for node in dev.nodes}:
        ancestor(parent)
    if res.pci:
        ancestor("/sys/bus/pci/devices")
    if res.usb:
        ancestor("/sys/bus/usb/devices")
    return out
