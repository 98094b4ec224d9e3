"""The plugin over real unix sockets without root: fake PCI devices whose nodes are plain files in a temp host root.

The root tiers (tests/e2e) use real device nodes; this keeps the servicer, registration and restart paths covered
where tests do not run as root, and shows that a preference over many devices leaves the event loop free.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

import grpc
import pytest

from deviceplugin import servicer
from deviceplugin.policy import preferred
from nodeplug.api.deviceplugin.v1beta1 import api_pb2
from nodeplug.paths import CDI_DIR

from lab.devicehost import FakeHost, alloc
from support.dpharness import Harness


def fake_pci(fake: FakeHost, addr: str, numa: int, group: int) -> None:
    fake.pci(addr, "10de", "2330", "030200", numa, group)
    fake.file(f"/dev/vfio/{group}")  # plain files: only their presence is checked for PCI nodes


@pytest.fixture
async def s(dp: Harness) -> Harness:
    for i, (numa, group) in enumerate([(0, 10), (0, 11), (1, 20), (1, 21)]):
        fake_pci(dp.fake, f"0000:0{i}:00.0", numa, group)
    await dp.start(dp.config([{"name": "gpu", "pci": [{"vendor": "10de"}], "cdi": True}]))
    return dp


async def test_register_list_prefer_allocate_restart(s: Harness) -> None:
    ep = await s.kubelet.wait_registered("nodeplug.io/gpu")
    assert ep.request.endpoint == "nodeplug-gpu.sock" and ep.request.version == "v1beta1"
    assert [(d[0], d[2]) for d in ep.latest] == [
        ("0000:00:00.0", (0,)),
        ("0000:01:00.0", (0,)),
        ("0000:02:00.0", (1,)),
        ("0000:03:00.0", (1,)),
    ]
    req = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=[d[0] for d in ep.latest],
                must_include_deviceIDs=["0000:03:00.0"],
                allocation_size=2,
            )
        ]
    )
    pref = await ep.stub.GetPreferredAllocation(req)
    assert list(pref.container_responses[0].deviceIDs) == ["0000:03:00.0", "0000:02:00.0"]

    alloc = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["0000:03:00.0", "0000:02:00.0"])]
    )
    resp = await ep.stub.Allocate(alloc)
    assert [d.name for d in resp.container_responses[0].cdi_devices] == [
        "nodeplug.io/gpu=0000:03:00.0",
        "nodeplug.io/gpu=0000:02:00.0",
    ]
    spec = json.loads((s.ctx.root(CDI_DIR) / "nodeplug.io-gpu.json").read_text())
    assert spec["devices"][3]["containerEdits"]["deviceNodes"][0]["hostPath"] == "/dev/vfio/21"

    os.unlink(s.host / "dev/vfio/21")  # its vfio group node goes away: unhealthy, Allocate refuses it
    await ep.wait_listing(lambda listing: listing[3][1] == "Unhealthy")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.Allocate(alloc)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "0000:03:00.0 (device node missing: /dev/vfio/21)" in (e.value.details() or "")

    fake_pci(s.fake, "0000:04:00.0", 1, 30)  # PCI hotplug on the fake tree
    await ep.wait_listing(lambda listing: len(listing) == 5)

    await s.kubelet.restart()
    again = await s.kubelet.wait_registered("nodeplug.io/gpu", after=1)
    assert len(again.latest) == 5
    assert s.plugin is not None and s.plugin.readiness().ready


async def test_usb_serial_adapters_by_vendor_product(dp: Harness) -> None:
    fake = dp.fake
    ftdi = fake.usb("1-1", "0403", "6001", serial="A10K", busdev="001/002", numa=0)
    fake.usb_tty(ftdi, "ttyUSB0")
    fake.file("/dev/bus/usb/001/002")
    fake.file("/dev/ttyUSB0")
    fake.usb("1-2", "046d", "c52b", busdev="001/003")  # a mouse: not ours
    await dp.start(dp.config([{"name": "serial", "usb": [{"vendor": "0403", "product": "6001"}]}]))
    ep = await dp.ep("serial")
    assert ep.latest == [("1-1", "Healthy", (0,))]
    resp = await ep.stub.Allocate(alloc(["1-1"]))
    assert [d.host_path for d in resp.container_responses[0].devices] == ["/dev/bus/usb/001/002", "/dev/ttyUSB0"]
    second = fake.usb("1-3", "0403", "6001", busdev="001/004")  # plugged in: sysfs (inotify on the fake tree)
    fake.usb_tty(second, "ttyUSB1")
    fake.file("/dev/bus/usb/001/004")
    fake.file("/dev/ttyUSB1")
    await ep.wait_listing(lambda listing: [d[0] for d in listing] == ["1-1", "1-3"])
    os.unlink(fake.root / "dev/ttyUSB0")  # the tty node vanished while the USB device stays: unhealthy
    await ep.wait_listing(lambda listing: listing[0][1] == "Unhealthy")


async def test_a_preference_in_progress_leaves_the_event_loop_serving(
    s: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: GetPreferredAllocation ran on the event loop, so a large one stalled every other RPC, /healthz and
    CNI. While one is being computed (held inside the policy here), the plugin still answers other calls."""
    ep = await s.kubelet.wait_registered("nodeplug.io/gpu")
    loop = asyncio.get_running_loop()
    inside, release = asyncio.Event(), threading.Event()
    released: list[bool] = []

    def held(*args: Any) -> list[str]:
        loop.call_soon_threadsafe(inside.set)
        # Code that computes on the event loop blocks the loop here, and nothing below can run until this gives up
        # (a deadlock breaker, never reached when the loop is free): it then reports False.
        released.append(release.wait(timeout=30))
        return preferred(*args)

    monkeypatch.setattr(servicer, "preferred", held)
    req = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=[d[0] for d in ep.latest], allocation_size=2
            )
        ]
    )
    call = asyncio.ensure_future(ep.stub.GetPreferredAllocation(req))
    try:
        await inside.wait()
        options = await ep.stub.GetDevicePluginOptions(api_pb2.Empty())  # answered while the preference is held
        assert options.get_preferred_allocation_available
        release.set()
        pref = await call
    finally:
        release.set()
        await asyncio.gather(call, return_exceptions=True)
    assert released == [True], "the preference was computed on the event loop, which stalled until it gave up"
    assert list(pref.container_responses[0].deviceIDs) == ["0000:00:00.0", "0000:01:00.0"]  # one NUMA node
