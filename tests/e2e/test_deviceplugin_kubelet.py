"""Registration with kubelet and the lifecycle around it: fields, waiting for kubelet, kubelet restarts,
a removed directory, rejected registrations, many streams. Re-registration is shown to follow the change that
calls for it (inotify), with the backoff timer set to an hour.

Through the ``dp`` fixture (tests/support/dpharness.py), with real device nodes (mknod) in its host root.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat

import pytest

from deviceplugin import resource
from deviceplugin.plugin import DevicePlugin
from nodeplug.api.deviceplugin.v1beta1 import api_pb2

from lab.devicehost import alloc
from support.dpharness import Harness
from support.wait import eventually

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes device nodes with mknod"),
]


async def test_registration_fields_initial_list_and_readiness(dp: Harness) -> None:
    dp.mknod("/dev/fuse")
    dp.mknod("/dev/net/tun")
    reset = {"command": ["true"]}
    plugin = await dp.start(
        dp.config(
            [{"name": "fuse", "devices": ["/dev/fuse"]}, {"name": "tun", "devices": ["/dev/net/tun"], "reset": reset}]
        )
    )
    fuse, tun = await dp.ep("fuse"), await dp.ep("tun")
    assert fuse.request.version == "v1beta1"
    assert fuse.request.endpoint == "nodeplug-fuse.sock"
    assert fuse.request.resource_name == "nodeplug.io/fuse"
    assert fuse.request.options == api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
    assert tun.request.options.pre_start_required and tun.request.options.get_preferred_allocation_available
    assert fuse.options == fuse.request.options
    assert fuse.latest == [("fuse", "Healthy", ())]
    assert tun.latest == [("net-tun", "Healthy", ())]
    sock = dp.plugin_dir / "nodeplug-fuse.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert plugin.readiness().ready, plugin.readiness()


@pytest.fixture
def no_timed_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register retries only after an hour: what happens within a test was triggered by a change the plugin saw."""
    monkeypatch.setattr(resource, "BACKOFF_MIN", 3600.0)
    monkeypatch.setattr(resource, "BACKOFF_MAX", 3600.0)


def registrations(plugin: DevicePlugin, result: str) -> float:
    value = plugin.ctx.metrics.registry.get_sample_value(
        "nodeplug_deviceplugin_registrations_total", {"resource": "fuse", "result": result}
    )
    return value or 0.0


async def test_waits_for_kubelet_then_registers(dp: Harness, no_timed_retry: None) -> None:
    dp.mknod("/dev/fuse")
    plugin = await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"]}]), kubelet=False)
    await eventually(lambda: registrations(plugin, "error") == 1, what="the first Register attempt")
    r = plugin.readiness()
    assert not r.ready and "fuse: not registered with kubelet" in r.detail
    await dp.kubelet.start()  # kubelet.sock appears: inotify, not the backoff timer, triggers Register
    await dp.ep("fuse")
    assert plugin.readiness().ready


async def test_kubelet_restart_reregisters_every_resource(dp: Harness, no_timed_retry: None) -> None:
    dp.mknod("/dev/fuse")
    dp.mknod("/dev/net/tun")
    plugin = await dp.start(
        dp.config([{"name": "fuse", "devices": ["/dev/fuse"]}, {"name": "tun", "devices": ["/dev/net/tun"]}])
    )
    await dp.ep("fuse")
    await dp.ep("tun")
    for round_ in (1, 2):
        await dp.kubelet.restart()  # streams closed, directory wiped (our sockets too), new kubelet.sock
        fuse = await dp.ep("fuse", after=round_)
        tun = await dp.ep("tun", after=round_)
        assert fuse.latest == [("fuse", "Healthy", ())] and tun.latest == [("net-tun", "Healthy", ())]
        await fuse.stub.Allocate(alloc(["fuse"]))
    assert plugin.readiness().ready
    assert registrations(plugin, "ok") == 3


async def test_directory_removed_and_made_again(dp: Harness, no_timed_retry: None) -> None:
    dp.mknod("/dev/fuse")
    await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"]}]))
    await dp.ep("fuse")
    await dp.kubelet.stop(wipe=True)
    dp.plugin_dir.rmdir()
    await eventually(dp.plugin_dir.is_dir, what="the plugin making its directory again")
    await dp.kubelet.start()
    ep = await dp.ep("fuse", after=1)
    assert ep.latest == [("fuse", "Healthy", ())]


async def test_rejected_registration_retries_with_backoff_and_logs_once(
    dp: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("nodeplug"), "propagate", True)  # log.setup() elsewhere turns it off
    dp.mknod("/dev/fuse")
    dp.kubelet.reject = "device manager not ready"
    await dp.kubelet.start()
    caplog.set_level(logging.INFO, logger="nodeplug.deviceplugin")
    plugin = await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"]}]), kubelet=False)
    await dp.kubelet.changes.until(lambda: len(dp.kubelet.attempts) >= 4, 10, lambda: "four Register attempts")
    # distinct records: after another test's log.setup() the same record can reach the capture handler twice
    warnings = {id(r) for r in caplog.records if r.getMessage().startswith("not registered")}
    assert len(warnings) == 1
    assert not plugin.readiness().ready
    dp.kubelet.reject = None
    await dp.kubelet.wait_registered("nodeplug.io/fuse", timeout=3)
    assert plugin.readiness().ready
    assert len({id(r) for r in caplog.records if r.getMessage() == "registered"}) == 1


async def test_every_stream_gets_every_change_and_cancelled_streams_end(dp: Harness) -> None:
    dp.mknod("/dev/ttyUSB0")
    plugin = await dp.start(dp.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    ep = await dp.ep("serial")
    calls = [ep.stub.ListAndWatch(api_pb2.Empty()) for _ in range(3)]
    firsts = [await c.read() for c in calls]
    assert all([d.ID for d in f.devices] == ["ttyUSB0"] for f in firsts)
    rt = plugin.resources["serial"]
    assert rt.updates.subscribers == 4  # the stand-in's stream and ours
    dp.mknod("/dev/ttyUSB1")
    for c in calls:
        msg = await asyncio.wait_for(c.read(), 5)
        assert [d.ID for d in msg.devices] == ["ttyUSB0", "ttyUSB1"]
    for c in calls:
        c.cancel()
    await eventually(lambda: rt.updates.subscribers == 1, what="only the stand-in's stream left")
    assert 'nodeplug_deviceplugin_streams{resource="serial"} 1.0' in plugin.ctx.metrics.render().decode()
