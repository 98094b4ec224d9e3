"""What kubelet sees of the devices: hotplug on /dev and a fake sysfs, health both ways (node presence and
health commands), NUMA topology and GetPreferredAllocation, which changes re-scan which resources.

Through the ``dp`` fixture (tests/support/dpharness.py), with real device nodes (mknod) in its host root.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin.plugin import DevicePlugin
from nodeplug.api.deviceplugin.v1beta1 import api_pb2

from lab.devicehost import alloc
from support.dpharness import Harness, health, ids
from support.wait import eventually, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes device nodes with mknod"),
]


def hca(dp: Harness, addr: str, numa: int, group: int) -> None:
    dp.fake.pci(addr, "15b3", "101b", "020700", numa, group)


async def test_hotplug_add_and_remove_seen_on_the_stream(dp: Harness) -> None:
    dp.mknod("/dev/ttyUSB0")
    await dp.start(dp.config([{"name": "serial", "devices": ["/dev/ttyUSB*"], "forget_after_seconds": 0}]))
    ep = await dp.ep("serial")
    assert ids(ep.latest) == ["ttyUSB0"]
    dp.mknod("/dev/ttyUSB1")  # how fast it is seen is bench-deviceplugin's business
    await ep.wait_listing(lambda listing: ids(listing) == ["ttyUSB0", "ttyUSB1"])
    before = len(ep.listings)
    for i in range(2, 12):  # a burst (made without yielding to the loop) is debounced into one or two updates
        dp.mknod(f"/dev/ttyUSB{i}")
    await ep.wait_listing(lambda listing: len(listing) == 12)
    assert len(ep.listings) - before <= 3
    assert ids(ep.latest)[-3:] == ["ttyUSB9", "ttyUSB10", "ttyUSB11"]  # natural order
    os.unlink(dp.host / "dev/ttyUSB0")
    await ep.wait_listing(lambda listing: "ttyUSB0" not in ids(listing))


async def test_vanished_node_is_unhealthy_and_healthy_again(dp: Harness) -> None:
    node = dp.mknod("/dev/ttyUSB0")
    dp.mknod("/dev/ttyUSB1")
    plugin = await dp.start(dp.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    ep = await dp.ep("serial")
    os.unlink(node)
    await ep.wait_listing(lambda listing: health(listing) == {"ttyUSB0": "Unhealthy", "ttyUSB1": "Healthy"})
    metrics = plugin.ctx.metrics.render().decode()
    assert 'nodeplug_deviceplugin_devices{health="Unhealthy",resource="serial"} 1.0' in metrics
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.Allocate(alloc(["ttyUSB0"]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ttyUSB0 (device is gone from the node)" in (e.value.details() or "")
    dp.mknod("/dev/ttyUSB0")
    await ep.wait_listing(lambda listing: health(listing) == {"ttyUSB0": "Healthy", "ttyUSB1": "Healthy"})
    await ep.stub.Allocate(alloc(["ttyUSB0"]))


async def test_health_command_flips_both_ways_and_times_out(dp: Harness) -> None:
    dp.mknod("/dev/fuse")
    flag = dp.base / "ok-fuse"
    flag.write_text("")
    cmd = {"command": ["test", "-e", str(dp.base / "ok-{id}")], "interval_seconds": 0.05, "timeout_seconds": 2}
    await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"], "health": cmd}]))
    ep = await dp.ep("fuse")
    await ep.wait_listing(lambda listing: health(listing) == {"fuse": "Healthy"})
    flag.unlink()
    await ep.wait_listing(lambda listing: health(listing) == {"fuse": "Unhealthy"})
    flag.write_text("")
    await ep.wait_listing(lambda listing: health(listing) == {"fuse": "Healthy"})


async def test_health_command_timeout_is_unhealthy(dp: Harness) -> None:
    dp.mknod("/dev/fuse")
    cmd = {"command": ["sleep", "5"], "interval_seconds": 0.05, "timeout_seconds": 0.1}
    plugin = await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"], "health": cmd}]))
    ep = await dp.ep("fuse")
    assert ep.latest == [("fuse", "Unhealthy", ())]  # not checked yet: never offered unchecked
    table = plugin.resources["fuse"].table
    await eventually(lambda: "timed out" in table.reason("fuse"), what="the health command timing out")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.Allocate(alloc(["fuse"]))
    assert "timed out after 0.1s" in (e.value.details() or "")


async def test_pci_numa_topology_and_preferred_allocation(dp: Harness) -> None:
    layout = {"0000:17:00.0": (0, 10), "0000:17:00.1": (0, 11), "0000:b3:00.0": (1, 20), "0000:b3:00.1": (1, 21)}
    for addr, (numa, group) in layout.items():
        hca(dp, addr, numa, group)
        dp.mknod(f"/dev/vfio/{group}")
    dp.mknod("/dev/vfio/vfio")
    res = {
        "name": "hca",
        "pci": [{"vendor": "15b3", "class_prefix": "0207"}],
        "nodes": ["/dev/vfio/vfio"],
        "replicas": 2,
    }
    await dp.start(dp.config([res]))
    ep = await dp.ep("hca")
    assert ep.latest[0] == ("0000:17:00.0::0", "Healthy", (0,))
    assert ep.latest[-1] == ("0000:b3:00.1::1", "Healthy", (1,))
    avail = ids(ep.latest)

    async def prefer(available: list[str], must: list[str], size: int) -> list[str]:
        req = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        )
        resp = await ep.stub.GetPreferredAllocation(req)
        return list(resp.container_responses[0].deviceIDs)

    # must_include on NUMA 1: stay on NUMA 1, on distinct physical devices
    assert await prefer(avail, ["0000:b3:00.0::1"], 2) == ["0000:b3:00.0::1", "0000:b3:00.1::0"]
    # three replicas fit on one NUMA node (four per node)
    got = await prefer(avail, [], 3)
    assert {a[:7] for a in got} == {"0000:17"} and len({a.split("::")[0] for a in got}) == 2
    # only from available: NUMA 0 mostly gone, so NUMA 1 is chosen
    assert await prefer(["0000:17:00.0::0", *avail[4:]], [], 2) == ["0000:b3:00.0::0", "0000:b3:00.1::0"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await prefer(avail[:1], ["0000:b3:00.0::0"], 2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must_include_deviceIDs not in available_deviceIDs: 0000:b3:00.0::0" in (e.value.details() or "")
    resp = await ep.stub.Allocate(alloc(["0000:b3:00.0::0", "0000:b3:00.0::1"]))
    assert [d.host_path for d in resp.container_responses[0].devices] == ["/dev/vfio/20", "/dev/vfio/vfio"]
    # PCI hotplug on the fake sysfs tree (inotify on the bus directory; uevents cover real sysfs)
    hca(dp, "0000:b3:00.2", 1, 22)
    await ep.wait_listing(lambda listing: "0000:b3:00.2::0" in ids(listing))
    assert health(ep.latest)["0000:b3:00.2::0"] == "Unhealthy"  # its vfio group node is not there yet
    dp.mknod("/dev/vfio/22")
    await ep.wait_listing(lambda listing: health(listing)["0000:b3:00.2::0"] == "Healthy")


def scans(plugin: DevicePlugin) -> dict[str, float]:
    """Discovery scans so far, per resource, from the plugin's metrics."""
    get = plugin.ctx.metrics.registry.get_sample_value
    return {name: get("nodeplug_deviceplugin_scans_total", {"resource": name}) or 0.0 for name in plugin.resources}


def trigger_uevent(sysfs_device: str) -> None:
    """Have the kernel send a "change" uevent for a device of this host (harmless; as root)."""
    with open(f"{sysfs_device}/uevent", "w") as f:
        f.write("change")


def host_pci_device() -> str:
    top = Path("/sys/bus/pci/devices")
    if not top.is_dir() or not any(top.iterdir()):
        pytest.skip("no PCI device on this host to send a kernel uevent for")
    return str(sorted(top.iterdir())[0])


async def test_uevents_rescan_sysfs_resources_and_inotify_only_the_watching_ones(dp: Harness) -> None:
    """Each step ends with a change only ``serial`` sees, whose listing proves that step's scan rounds are over
    (rounds run one at a time; a uevent read before the change is in the same round or an earlier one). The kernel
    uevents are real, for this host's devices; the PCI resource reads the fake sysfs, and any PCI uevent re-scans it.
    (Another process making non-virtual uevents on this host during the test would add PCI scans.)"""
    hca(dp, "0000:17:00.0", 0, 10)
    dp.mknod("/dev/vfio/10")
    dp.mknod("/dev/fuse")
    (dp.host / "dev/serial").mkdir()
    res: list[dict[str, Any]] = [
        {"name": "hca", "pci": [{"vendor": "15b3"}]},
        {"name": "fuse", "devices": ["/dev/fuse"]},
        {"name": "serial", "devices": ["/dev/serial/tty*"]},
    ]
    plugin = await dp.start(dp.config(res))
    serial = await dp.ep("serial")
    before = scans(plugin)

    def since() -> dict[str, float]:
        now = scans(plugin)
        return {name: now[name] - before[name] for name in now}

    # a virtual device's uevent (a pod's veth, a loop device: /sys/devices/virtual/...) re-scans nothing
    trigger_uevent("/sys/devices/virtual/mem/null")
    dp.mknod("/dev/serial/tty0")
    await serial.wait_listing(lambda listing: ids(listing) == ["serial-tty0"])
    assert since() == {"hca": 0, "fuse": 0, "serial": 1}
    # a PCI device's uevent re-scans the resources that read sysfs, and those only
    before = scans(plugin)
    trigger_uevent(host_pci_device())
    dp.mknod("/dev/serial/tty1")
    await serial.wait_listing(lambda listing: ids(listing) == ["serial-tty0", "serial-tty1"])
    assert since()["hca"] >= 1 and {k: v for k, v in since().items() if k != "hca"} == {"fuse": 0, "serial": 1}
    # a change in /dev itself: fuse watches it (hca watches its vfio nodes' directory, serial /dev/serial)
    before = scans(plugin)
    dp.mknod("/dev/other")
    await eventually(lambda: since()["fuse"] >= 1, what="a re-scan of fuse")
    dp.mknod("/dev/serial/tty2")
    await serial.wait_listing(lambda listing: len(listing) == 3)
    assert since() == {"hca": 0, "fuse": 1, "serial": 1}


async def test_a_slow_sysfs_scan_leaves_the_loop_answering_kubelet(dp: Harness) -> None:
    """A full PCI re-scan of a large host takes about a second: it reads on a thread, and Allocate on another
    resource is answered while it is held; its result still reaches the stream once it is done. The slow read is
    real: the hotplugged function's ``vendor`` file in the fake sysfs is a FIFO, and the scan's read waits for the
    test to write it."""
    hca(dp, "0000:17:00.0", 0, 10)
    dp.mknod("/dev/vfio/10")
    dp.mknod("/dev/fuse")
    res: list[dict[str, Any]] = [
        {"name": "hca", "pci": [{"vendor": "15b3"}]},
        {"name": "fuse", "devices": ["/dev/fuse"]},
    ]
    await dp.start(dp.config(res))
    hca_ep, fuse_ep = await dp.ep("hca"), await dp.ep("fuse")
    dp.mknod("/dev/vfio/11")
    function = dp.fake.pci("0000:17:00.1", "15b3", "101b", "020700", 0, 11, linked=False)
    vendor = function / "vendor"
    vendor.unlink()
    os.mkfifo(vendor)
    dp.fake.link_pci("0000:17:00.1")  # hotplug: inotify on the bus directory re-scans the PCI resource
    try:
        writer = await asyncio.to_thread(wait_for, "the PCI re-scan reading the FIFO", lambda: open_writer(vendor), 30)
        resp = await asyncio.wait_for(fuse_ep.stub.Allocate(alloc(["fuse"])), 30)  # the scan is held meanwhile
        assert [d.host_path for d in resp.container_responses[0].devices] == ["/dev/fuse"]
        assert ids(hca_ep.latest) == ["0000:17:00.0"]
        os.write(writer, b"0x15b3\n")
        os.close(writer)
        await hca_ep.wait_listing(
            lambda listing: health(listing) == {"0000:17:00.0": "Healthy", "0000:17:00.1": "Healthy"}
        )
    finally:  # a regular file from now on; a scan that opened the FIFO meanwhile reads an empty one
        keep = os.open(vendor, os.O_RDWR | os.O_NONBLOCK)
        (function / "vendor.new").write_text("0x15b3\n")
        os.replace(function / "vendor.new", vendor)
        os.close(keep)


def open_writer(fifo: Path) -> int | None:
    """A write end of ``fifo`` once a reader has it open (None until then)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:  # no reader yet
            return None
        raise


async def test_directory_that_appears_later_is_watched(dp: Harness) -> None:
    await dp.start(dp.config([{"name": "gpu", "devices": ["/dev/dri/renderD*"]}]))
    ep = await dp.ep("gpu")
    assert ep.latest == []
    # /dev is watched (the nearest existing ancestor), then /dev/dri itself, and it is scanned once watched: a node
    # made before the new watch is in place is not missed
    (dp.host / "dev/dri").mkdir()
    dp.mknod("/dev/dri/renderD128")
    await ep.wait_listing(lambda listing: ids(listing) == ["dri-renderD128"])


async def test_gone_device_is_forgotten_after_the_grace(dp: Harness) -> None:
    node = dp.mknod("/dev/ttyUSB0")
    plugin = await dp.start(dp.config([{"name": "serial", "devices": ["/dev/ttyUSB*"], "forget_after_seconds": 0.3}]))
    ep = await dp.ep("serial")
    os.unlink(node)
    await ep.wait_listing(lambda listing: health(listing) == {"ttyUSB0": "Unhealthy"})
    assert plugin.resources["serial"].next_expiry() is not None  # listed unhealthy, forgotten on a timer
    await ep.wait_listing(lambda listing: listing == [])


async def test_without_inotify_it_polls_every_second(dp: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_inotify(*_: Any) -> None:
        raise OSError(24, "inotify_init1: Too many open files")

    monkeypatch.setattr("deviceplugin.plugin.Inotify", no_inotify)
    plugin = await dp.start(dp.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    assert plugin.polling
    ep = await dp.ep("serial")
    dp.mknod("/dev/ttyUSB0")
    await ep.wait_listing(lambda listing: ids(listing) == ["ttyUSB0"])  # the next poll, within a second
    await dp.kubelet.restart()
    await dp.ep("serial", after=1)
