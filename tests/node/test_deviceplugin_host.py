"""The device plugin's edges on the real kernel: uevents, this host's sysfs and /dev, a loop block device."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deviceplugin.config import Config, PciMatch, Resource
from deviceplugin.discovery import discover
from deviceplugin.plugin import DevicePlugin
from deviceplugin.uevent import UeventMonitor
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

from lab.devicehost import short_tempdir
from support.wait import eventually

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: triggers kernel uevents, uses loop devices")

NULL_UEVENT = "/sys/devices/virtual/mem/null/uevent"


def first_pci() -> tuple[str, str, str, int | None]:
    top = Path("/sys/bus/pci/devices")
    if not top.is_dir() or not any(top.iterdir()):
        pytest.skip("no PCI devices on this host")
    d = sorted(top.iterdir())[0]
    vendor, device = ((d / f).read_text().strip().removeprefix("0x") for f in ("vendor", "device"))
    numa = int((d / "numa_node").read_text()) if (d / "numa_node").exists() else -1
    return d.name, vendor, device, numa if numa >= 0 else None


def trigger(uevent_file: str) -> None:
    """Ask the kernel to send a synthetic "change" uevent for a device (harmless)."""
    with open(uevent_file, "w") as f:
        f.write("change")


@pytest.fixture
def short() -> Iterator[Path]:
    d = short_tempdir()  # unix socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d)


async def test_uevent_monitor_receives_kernel_uevents() -> None:
    got: list[tuple[str, dict[str, str]]] = []
    seen = asyncio.Event()

    def cb(action: str, fields: dict[str, str]) -> None:
        if fields.get("DEVPATH") == "/devices/virtual/mem/null":
            got.append((action, fields))
            seen.set()

    mon = UeventMonitor(cb)
    try:
        trigger(NULL_UEVENT)
        await asyncio.wait_for(seen.wait(), 2)
    finally:
        mon.close()
    action, fields = got[0]
    assert action == "change" and fields["SUBSYSTEM"] == "mem" and fields["DEVNAME"] == "null"


def test_pci_discovery_on_this_host() -> None:
    addr, vendor, device, numa = first_pci()
    res = Resource(name="pci", pci=[PciMatch(vendor=vendor, device=device, nodes=["/dev/null"])])
    found = {d.id: d for d in discover(res, "/").devices}
    assert addr in found
    dev = found[addr]
    assert dev.numa == numa and dev.address == addr
    assert [n.host_path for n in dev.nodes] == ["/dev/null"] and dev.missing == ()


def test_block_device_glob(loop_device: Callable[[int], str]) -> None:
    dev = loop_device(1 << 20)
    name = os.path.basename(dev)
    found = discover(Resource(name="loops", devices=["/dev/loop[0-9]*"]), "/").devices
    ours = [d for d in found if d.id == name]
    assert len(ours) == 1 and ours[0].nodes[0].host_path == dev and ours[0].missing == ()


async def test_kernel_uevent_rescans_sysfs_resources(short: Path) -> None:
    addr, vendor, device, _ = first_pci()
    cfg = Config.model_validate(
        {
            "host_root": "/",
            "resources": [
                {"name": "pci", "pci": [{"vendor": vendor, "device": device, "nodes": ["/dev/null"]}]},
                {"name": "nulls", "devices": ["/dev/null"]},
            ],
        }
    )
    plugin = DevicePlugin(cfg, AgentContext(root=Root(short)))
    await plugin.start()
    try:

        def scans(name: str) -> float:
            got = plugin.ctx.metrics.registry.get_sample_value("nodeplug_deviceplugin_scans_total", {"resource": name})
            return got or 0.0

        assert [e.id for e in plugin.resources["pci"].table.listing] == [addr]
        before = scans("pci")
        trigger(f"/sys/bus/pci/devices/{addr}/uevent")
        await eventually(lambda: scans("pci") > before, what="a re-scan of the PCI resource")
        # which resources a uevent re-scans, and which it does not: tests/e2e/test_deviceplugin_devices.py
    finally:
        await plugin.stop(0)
