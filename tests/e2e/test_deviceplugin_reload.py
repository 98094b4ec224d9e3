"""Reload (in process and through the agent's SIGHUP), metrics and doctor, with a kubelet stand-in."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.config import Config
from deviceplugin.doctor import checks
from deviceplugin.plugin import DevicePlugin
from nodeplug.api.deviceplugin.v1beta1 import api_pb2
from nodeplug.checks import CheckFailed, CheckSkipped
from nodeplug.config import ConfigError, parse
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

from lab.devicehost import alloc
from support.agent import free_port
from support.dpharness import Harness
from support.wait import eventually

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes device nodes with mknod"),
]

REPO = Path(__file__).resolve().parents[2]


def section(host: Path, resources: list[dict[str, Any]]) -> dict[str, Any]:
    return {"host_root": str(host), "resources": resources}


FUSE = {"name": "fuse", "devices": ["/dev/fuse"]}
TUN = {"name": "tun", "devices": ["/dev/net/tun"]}
SERIAL = {"name": "serial", "devices": ["/dev/ttyUSB*"]}


@pytest.fixture
async def running(dp: Harness) -> tuple[Harness, DevicePlugin]:
    for node in ("/dev/fuse", "/dev/net/tun", "/dev/ttyUSB0"):
        dp.mknod(node)
    return dp, await dp.start(dp.config([FUSE, TUN]))


async def test_reload_add_remove_change_and_keep(running: tuple[Harness, DevicePlugin]) -> None:
    dp, plugin = running
    kubelet = dp.kubelet
    fuse = await kubelet.wait_registered("nodeplug.io/fuse")
    await kubelet.wait_registered("nodeplug.io/tun")
    own = fuse.stub.ListAndWatch(api_pb2.Empty())
    assert [d.ID for d in (await own.read()).devices] == ["fuse"]
    fuse_runtime = plugin.resources["fuse"]
    tun_runtime = plugin.resources["tun"]
    tun_sock = dp.plugin_dir / "nodeplug-tun.sock"

    changed_tun = {**TUN, "replicas": 2}
    await plugin.reload(dp.config([FUSE, changed_tun, SERIAL]))
    serial = await kubelet.wait_registered("nodeplug.io/serial")  # added
    assert serial.latest == [("ttyUSB0", "Healthy", ())]
    tun = await kubelet.wait_registered("nodeplug.io/tun", after=1)  # changed: restarted and registered again
    assert [d[0] for d in tun.latest] == ["net-tun::0", "net-tun::1"]
    assert plugin.resources["tun"] is not tun_runtime
    assert plugin.resources["fuse"] is fuse_runtime and kubelet.count("nodeplug.io/fuse") == 1  # unchanged
    dp.mknod("/dev/ttyUSB1")  # the kept resource's streams still work: ours sees nothing (fuse unchanged) ...
    await serial.wait_listing(lambda listing: len(listing) == 2)
    assert not fuse.stream_ended and fuse_runtime.updates.subscribers == 2
    own.cancel()

    await plugin.reload(dp.config([FUSE, SERIAL]))  # tun removed
    assert not tun_sock.exists()
    assert "tun" not in plugin.resources
    await tun.wait_listing(lambda listing: tun.stream_ended)  # kubelet sees the stream end
    assert plugin.readiness().ready


async def test_bad_config_is_rejected_with_field_names(running: tuple[Harness, DevicePlugin]) -> None:
    dp, plugin = running
    await dp.ep("fuse")
    # both resources registered (the kubelet stand-in sees a Register before the plugin has its answer): ready
    await eventually(lambda: plugin.readiness().ready, timeout=30, what="both resources registered")
    bad = section(dp.host, [FUSE, {"name": "nic", "pci": [{"vendor": "80860"}]}])
    with pytest.raises(ConfigError) as e:
        parse({"deviceplugin": bad})
    assert e.value.problems == ["deviceplugin.resources[1].pci[0].vendor: expected 4 hex digits, got '80860'"]
    # the shell hands a plugin only a parsed section, so the refused file never reaches it: it keeps what it serves
    assert plugin.readiness().ready and set(plugin.resources) == {"fuse", "tun"}


async def test_metrics(running: tuple[Harness, DevicePlugin]) -> None:
    dp, _ = running
    ep = await dp.ep("fuse")
    await dp.ep("tun")
    for _ in range(3):
        await ep.stub.Allocate(alloc(["fuse"]))
    text = dp.ctx.metrics.render().decode()
    for line in (
        'nodeplug_deviceplugin_devices{health="Healthy",resource="fuse"} 1.0',
        'nodeplug_deviceplugin_devices{health="Unhealthy",resource="fuse"} 0.0',
        'nodeplug_deviceplugin_registered{resource="tun"} 1.0',
        'nodeplug_deviceplugin_streams{resource="fuse"} 1.0',
        'nodeplug_deviceplugin_allocations_total{resource="fuse"} 3.0',
        'nodeplug_deviceplugin_registrations_total{resource="fuse",result="ok"} 1.0',
        'nodeplug_deviceplugin_allocate_duration_seconds_count{resource="fuse"} 3.0',
        'nodeplug_rpc_total{code="OK",method="/v1beta1.DevicePlugin/Allocate",plugin="deviceplugin"} 3.0',
    ):
        assert line in text, line


async def test_doctor_round_trip_and_skip(running: tuple[Harness, DevicePlugin]) -> None:
    dp, plugin = running
    await dp.ep("fuse")
    await dp.ep("tun")
    cfg = dp.config([FUSE, TUN])
    results = {c.name: await c.run() for c in checks(cfg, dp.ctx) if c.group == "deviceplugin"}
    assert results["host root"] == f"{dp.host} has dev and sys"
    assert results["fuse discovery"] == "1 device"
    assert results["fuse serving"].startswith("serving 1 device (1 healthy); kubelet.sock present")
    assert results["change detection"] == "inotify and kernel uevents"
    assert results["fuse allocate"] == "fuse -> /dev/fuse"
    await plugin.stop(0)
    for c in checks(cfg, dp.ctx):
        if c.name in ("fuse serving", "tun allocate"):
            with pytest.raises(CheckSkipped, match="the agent is not running"):
                await c.run()


async def test_host_root_check_fails_without_sys(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    cfg = Config.model_validate(section(tmp_path, [FUSE]))
    check = next(c for c in checks(cfg, AgentContext(root=Root(tmp_path / "root"))) if c.name == "host root")
    with pytest.raises(CheckFailed, match="sys is not readable"):
        await check.run()


# ---------------------------------------------------------------- the whole agent, reloaded with SIGHUP


async def test_agent_process_reload_on_sighup(dp: Harness) -> None:
    host, root, kubelet = dp.host, dp.ctx.root.path, dp.kubelet
    for node in ("/dev/fuse", "/dev/net/tun"):
        dp.mknod(node)
    await kubelet.start()
    conf = dp.base / "agent.yaml"

    def write(resources: list[dict[str, Any]]) -> None:
        doc = {
            "http": {"address": f"127.0.0.1:{free_port()}"},
            "csi": {"enabled": False},
            "cni": {"enabled": False},
            "deviceplugin": section(host, resources),
        }
        conf.write_text(yaml.safe_dump(doc))

    write([FUSE])
    log = (dp.base / "agent.log").open("w")
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "nodeplug.cli", "agent", "--config", str(conf), "--root", str(root)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        fuse = await kubelet.wait_registered("nodeplug.io/fuse", timeout=30)
        write([FUSE, TUN])
        proc.send_signal(signal.SIGHUP)
        tun = await kubelet.wait_registered("nodeplug.io/tun", timeout=10)
        assert tun.latest == [("net-tun", "Healthy", ())]
        assert kubelet.count("nodeplug.io/fuse") == 1 and not fuse.stream_ended  # unchanged: kept its stream
        conf.write_text(conf.read_text().replace("name: tun", "name: TUN!"))  # bad: rejected, the running one stays
        proc.send_signal(signal.SIGHUP)
        log_file = dp.base / "agent.log"
        await eventually(lambda: "new config rejected" in log_file.read_text(), 10, "the bad config's rejection")
        assert (dp.plugin_dir / "nodeplug-tun.sock").exists()
        write([TUN])
        proc.send_signal(signal.SIGHUP)
        await fuse.wait_listing(lambda _: fuse.stream_ended, 10)
        assert not (dp.plugin_dir / "nodeplug-fuse.sock").exists()
        resp = await tun.stub.Allocate(alloc(["net-tun"]))
        assert resp.container_responses[0].devices[0].host_path == "/dev/net/tun"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()
    text = (dp.base / "agent.log").read_text()
    assert proc.returncode == 0, text
    assert "deviceplugin.resources[1].name: expected a DNS label" in text
    assert not list(dp.plugin_dir.glob("nodeplug-*.sock"))  # stop removed every socket


async def test_start_removes_leftovers_of_a_killed_agent(dp: Harness) -> None:
    dp.mknod("/dev/fuse")
    plugin_dir, cdi_dir = dp.plugin_dir, dp.cdi_dir
    plugin_dir.mkdir(parents=True)
    cdi_dir.mkdir(parents=True)
    old = socket.socket(socket.AF_UNIX)
    old.bind(str(plugin_dir / "nodeplug-gone.sock"))  # a resource the old config had
    old.close()
    (plugin_dir / "other-vendor.sock").write_text("")  # not ours: untouched
    (cdi_dir / "nodeplug.io-gone.json").write_text("{}")
    (cdi_dir / "nodeplug.io-fuse.json").write_text("{}")  # fuse is configured, but without CDI now
    (cdi_dir / "vendor.com-gpu.json").write_text("{}")  # not ours: untouched
    plugin = await dp.start(dp.config([FUSE]), kubelet=False)
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["nodeplug-fuse.sock", "other-vendor.sock"]
    assert sorted(p.name for p in cdi_dir.iterdir()) == ["vendor.com-gpu.json"]
    await plugin.stop(0)
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["other-vendor.sock"]
