"""Registration with kubelet and the lifecycle around it: fields, waiting for kubelet, kubelet restarts,
a removed directory, rejected registrations, many streams.

Driven as kubelet drives the plugin: a kubelet stand-in (v1beta1 Registration server from the generated stubs) on a
temp ``kubelet.sock``, real device nodes made with mknod in a temp host root, a fake sysfs for PCI and NUMA.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import AsyncIterator

import pytest

from deviceplugin.testing import Harness, alloc, harness
from nodeplug.api.deviceplugin.v1beta1 import api_pb2

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes device nodes with mknod"),
]


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with harness() as h:
        yield h


async def test_registration_fields_initial_list_and_readiness(h: Harness) -> None:
    h.mknod("/dev/fuse")
    h.mknod("/dev/net/tun")
    reset = {"command": ["true"]}
    plugin = await h.start(
        h.config(
            [{"name": "fuse", "devices": ["/dev/fuse"]}, {"name": "tun", "devices": ["/dev/net/tun"], "reset": reset}]
        )
    )
    fuse, tun = await h.ep("fuse"), await h.ep("tun")
    assert fuse.request.version == "v1beta1"
    assert fuse.request.endpoint == "nodeplug-fuse.sock"
    assert fuse.request.resource_name == "nodeplug.io/fuse"
    assert fuse.request.options == api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
    assert tun.request.options.pre_start_required and tun.request.options.get_preferred_allocation_available
    assert fuse.options == fuse.request.options
    assert fuse.latest == [("fuse", "Healthy", ())]
    assert tun.latest == [("net-tun", "Healthy", ())]
    sock = h.plugin_dir / "nodeplug-fuse.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert plugin.readiness().ready, plugin.readiness()


async def test_waits_for_kubelet_then_registers(h: Harness) -> None:
    h.mknod("/dev/fuse")
    plugin = await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"]}]), kubelet=False)
    await asyncio.sleep(0.2)
    r = plugin.readiness()
    assert not r.ready and "fuse: not registered with kubelet" in r.detail
    t0 = time.monotonic()
    await h.kubelet.start()  # kubelet.sock appears: inotify, not the backoff timer, triggers Register
    await h.ep("fuse")
    assert time.monotonic() - t0 < 1.0
    assert plugin.readiness().ready


async def test_kubelet_restart_reregisters_every_resource(h: Harness) -> None:
    h.mknod("/dev/fuse")
    h.mknod("/dev/net/tun")
    plugin = await h.start(
        h.config([{"name": "fuse", "devices": ["/dev/fuse"]}, {"name": "tun", "devices": ["/dev/net/tun"]}])
    )
    await h.ep("fuse")
    await h.ep("tun")
    for round_ in (1, 2):
        t0 = time.monotonic()
        await h.kubelet.restart()  # streams closed, directory wiped (our sockets too), new kubelet.sock
        fuse = await h.ep("fuse", after=round_)
        tun = await h.ep("tun", after=round_)
        assert time.monotonic() - t0 < 1.0
        assert fuse.latest == [("fuse", "Healthy", ())] and tun.latest == [("net-tun", "Healthy", ())]
        await fuse.stub.Allocate(alloc(["fuse"]))
    assert plugin.readiness().ready
    assert 'nodeplug_deviceplugin_registrations_total{resource="fuse",result="ok"} 3.0' in (
        plugin.ctx.metrics.render().decode()
    )


async def test_directory_removed_and_made_again(h: Harness) -> None:
    h.mknod("/dev/fuse")
    await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"]}]))
    await h.ep("fuse")
    await h.kubelet.stop(wipe=True)
    h.plugin_dir.rmdir()
    await asyncio.sleep(0.05)
    await h.kubelet.start()
    ep = await h.ep("fuse", after=1)
    assert ep.latest == [("fuse", "Healthy", ())]


async def test_rejected_registration_retries_with_backoff_and_logs_once(
    h: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("nodeplug"), "propagate", True)  # log.setup() elsewhere turns it off
    h.mknod("/dev/fuse")
    h.kubelet.reject = "device manager not ready"
    await h.kubelet.start()
    caplog.set_level(logging.INFO, logger="nodeplug.deviceplugin")
    plugin = await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"]}]), kubelet=False)
    await asyncio.sleep(0.5)  # attempts at about 0, 50, 150, 350 ms
    errors = 'nodeplug_deviceplugin_registrations_total{resource="fuse",result="error"}'
    text = plugin.ctx.metrics.render().decode()
    attempts = float(next(line for line in text.splitlines() if line.startswith(errors)).split()[-1])
    assert 3 <= attempts <= 6
    # distinct records: after another test's log.setup() the same record can reach the capture handler twice
    warnings = {id(r) for r in caplog.records if r.getMessage().startswith("not registered")}
    assert len(warnings) == 1
    assert not plugin.readiness().ready
    h.kubelet.reject = None
    await h.kubelet.wait_registered("nodeplug.io/fuse", timeout=3)
    assert plugin.readiness().ready
    assert len({id(r) for r in caplog.records if r.getMessage() == "registered"}) == 1


async def test_every_stream_gets_every_change_and_cancelled_streams_end(h: Harness) -> None:
    h.mknod("/dev/ttyUSB0")
    plugin = await h.start(h.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    ep = await h.ep("serial")
    calls = [ep.stub.ListAndWatch(api_pb2.Empty()) for _ in range(3)]
    firsts = [await c.read() for c in calls]
    assert all([d.ID for d in f.devices] == ["ttyUSB0"] for f in firsts)
    rt = plugin.resources["serial"]
    assert rt.updates.subscribers == 4  # the stand-in's stream and ours
    h.mknod("/dev/ttyUSB1")
    for c in calls:
        msg = await asyncio.wait_for(c.read(), 1)
        assert [d.ID for d in msg.devices] == ["ttyUSB0", "ttyUSB1"]
    for c in calls:
        c.cancel()
    for _ in range(200):
        if rt.updates.subscribers == 1:
            break
        await asyncio.sleep(0.01)
    assert rt.updates.subscribers == 1
    assert 'nodeplug_deviceplugin_streams{resource="serial"} 1.0' in plugin.ctx.metrics.render().decode()
