"""Helpers for the tests and the benchmark: a fake host root, and the plugin under a kubelet stand-in.

:class:`FakeHost` builds what discovery reads in a temporary directory: device nodes (real character nodes with
``mknod`` when root, plain files otherwise, which is enough for PCI/USB node checks) and a fake sysfs with PCI
functions (vendor, device, class, NUMA node, IOMMU group), linked from ``sys/bus/pci/devices`` like the real one.

:class:`Harness` is one plugin on a temporary agent root with a :class:`~deviceplugin.kubeletstub.FakeKubelet`.
Unix socket paths are limited to 107 bytes, so :func:`short_tempdir` makes directories directly under the system
temporary directory rather than in a deep per-test path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deviceplugin.config import Config
from deviceplugin.kubeletstub import Endpoint, FakeKubelet, Listing
from deviceplugin.plugin import DevicePlugin, create
from nodeplug.api.deviceplugin.v1beta1 import api_pb2
from nodeplug.paths import CDI_DIR, DEVICE_PLUGIN_DIR, Root
from nodeplug.plugin import AgentContext


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
        self, addr: str, vendor: str, device: str, klass: str, numa: int = -1, iommu_group: int | None = None
    ) -> Path:
        d = self.root / "sys/devices/pci0000:00" / addr
        d.mkdir(parents=True)
        for name, text in {"vendor": vendor, "device": device, "class": klass, "numa_node": str(numa)}.items():
            (d / name).write_text(("0x" if name != "numa_node" else "") + text + "\n")
        if iommu_group is not None:
            g = self.root / f"sys/kernel/iommu_groups/{iommu_group}"
            g.mkdir(parents=True, exist_ok=True)
            (d / "iommu_group").symlink_to(os.path.relpath(g, d))
        link = self.root / "sys/bus/pci/devices" / addr
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(d, link.parent))
        return d

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


class Harness:
    """The plugin on a temporary agent root, a kubelet stand-in on its kubelet.sock, and a fake host."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.fake = FakeHost(base / "host")
        self.host = self.fake.root
        self.ctx = AgentContext(root=Root(base / "root"))
        self.plugin_dir = self.ctx.root(DEVICE_PLUGIN_DIR)
        self.cdi_dir = self.ctx.root(CDI_DIR)
        self.kubelet = FakeKubelet(self.plugin_dir)
        self.plugin: DevicePlugin | None = None

    def mknod(self, host_path: str) -> Path:
        return self.fake.node(host_path)

    def config(self, resources: list[dict[str, Any]], **kw: Any) -> Config:
        return Config.model_validate({"host_root": str(self.host), "resources": resources, **kw})

    async def start(self, cfg: Config, kubelet: bool = True) -> DevicePlugin:
        if kubelet:
            await self.kubelet.start()
        self.plugin = create(cfg, self.ctx)
        await self.plugin.start()
        return self.plugin

    async def ep(self, name: str, after: int = 0) -> Endpoint:
        return await self.kubelet.wait_registered(f"nodeplug.io/{name}", after=after)

    async def close(self) -> None:
        try:
            if self.plugin is not None:
                await self.plugin.stop(0)
            await self.kubelet.stop()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


@contextlib.asynccontextmanager
async def harness() -> AsyncIterator[Harness]:
    """A :class:`Harness` in a fresh :func:`short_tempdir`, closed on exit; then no task of it may be left."""
    h = Harness(short_tempdir())
    try:
        yield h
    finally:
        await h.close()
    await assert_no_tasks_left()


def alloc(*containers: list[str]) -> api_pb2.AllocateRequest:
    """An Allocate request with one container request per list of device IDs."""
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )


def ids(listing: Listing) -> list[str]:
    return [d[0] for d in listing]


def health(listing: Listing) -> dict[str, str]:
    return {d[0]: d[1] for d in listing}


async def assert_no_tasks_left(grace: float = 2.0) -> None:
    """Fail if a task outlives the plugin; tasks that are merely finishing (a closed gRPC call delivering its final
    status) get ``grace`` seconds to end first, while a leaked loop never would."""
    current = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not current]
    if pending:
        _done, still = await asyncio.wait(pending, timeout=grace)
        assert not still, f"tasks left behind: {sorted(still, key=id)}"
