"""A fake host root for device discovery, used by the device-plugin tests and the benchmark.

:class:`FakeHost` builds what discovery reads in a temporary directory: device nodes (real character nodes with
``mknod`` when root, plain files otherwise, which is enough for PCI/USB node checks) and a fake sysfs with PCI
functions (vendor, device, class, NUMA node, IOMMU group) and USB devices, linked from ``sys/bus/*/devices`` like the
real one. Unix socket paths are limited to 107 bytes, so :func:`short_tempdir` makes directories directly under the
system temporary directory rather than in a deep per-test path.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from nodeplug.api.deviceplugin.v1beta1 import api_pb2


def short_tempdir(prefix: str = "npdp-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


class FakeHost:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "dev").mkdir(parents=True, exist_ok=True)
        (root / "sys").mkdir(parents=True, exist_ok=True)

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def node(self, host_path: str) -> Path:
        """A character device node with the numbers of /dev/null (needs root)."""
        p = self.path(host_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(p, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
        return p

    def file(self, host_path: str) -> Path:
        """A plain file standing in for a device node where only its presence matters (PCI/USB nodes)."""
        p = self.path(host_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
        return p

    def pci(
        self,
        addr: str,
        vendor: str,
        device: str,
        klass: str,
        numa: int = -1,
        iommu_group: int | None = None,
        linked: bool = True,
    ) -> Path:
        """A PCI function's sysfs directory, linked from ``sys/bus/pci/devices`` (the hotplug discovery sees) unless
        ``linked`` is false: then :meth:`link_pci` does that later."""
        d = self.root / "sys/devices/pci0000:00" / addr
        d.mkdir(parents=True)
        for name, text in {"vendor": vendor, "device": device, "class": klass, "numa_node": str(numa)}.items():
            (d / name).write_text(("0x" if name != "numa_node" else "") + text + "\n")
        if iommu_group is not None:
            g = self.root / f"sys/kernel/iommu_groups/{iommu_group}"
            g.mkdir(parents=True, exist_ok=True)
            (d / "iommu_group").symlink_to(os.path.relpath(g, d))
        if linked:
            self.link_pci(addr)
        return d

    def link_pci(self, addr: str) -> None:
        d = self.root / "sys/devices/pci0000:00" / addr
        link = self.root / "sys/bus/pci/devices" / addr
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(d, link.parent))

    def usb(
        self, name: str, vendor: str, product: str, serial: str | None = None, busdev: str = "001/002", numa: int = -1
    ) -> Path:
        """A USB device under a fake xHCI controller, with its bus node; add ttys with :meth:`usb_tty`."""
        ctrl = self.root / "sys/devices/pci0000:00/0000:00:14.0"
        ctrl.mkdir(parents=True, exist_ok=True)
        if numa >= 0 or not (ctrl / "numa_node").exists():  # the controller is shared: keep a NUMA node once set
            (ctrl / "numa_node").write_text(f"{numa}\n")
        d = ctrl / "usb1" / name
        d.mkdir(parents=True)
        files = {"idVendor": vendor, "idProduct": product, "dev": "189:1", "uevent": f"DEVNAME=bus/usb/{busdev}"}
        if serial is not None:
            files["serial"] = serial
        for f, text in files.items():
            (d / f).write_text(text + "\n")
        link = self.root / "sys/bus/usb/devices" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(d, link.parent))
        return d

    def usb_tty(self, usb_dir: Path, tty: str) -> None:
        """A tty node under a USB device's first interface, as usb-serial drivers make them."""
        d = usb_dir / f"{usb_dir.name}:1.0" / tty / "tty" / tty
        d.mkdir(parents=True)
        (d / "dev").write_text("188:0\n")
        (d / "uevent").write_text(f"MAJOR=188\nMINOR=0\nDEVNAME={tty}\n")


def alloc(*containers: list[str]) -> api_pb2.AllocateRequest:
    """An Allocate request with one container request per list of device IDs."""
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )
