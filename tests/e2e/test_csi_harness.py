"""The CSI plugin itself, on a temporary root: sockets, readiness, kubelet registration, reload, kill -9."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from grpc import aio

from csi.config import Config
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.api.pluginregistration.v1 import api_pb2, api_pb2_grpc

from support.csidriver import DRIVER, Driver, running_driver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")


# ---------------------------------------------------------------- the plugin itself


async def test_sockets_readiness_and_kubelet_registration() -> None:
    async with running_driver() as d:
        assert d.plugin is not None
        sock = d.root / "var/lib/kubelet/plugins" / DRIVER / "csi.sock"
        reg_sock = d.root / "var/lib/kubelet/plugins_registry" / f"{DRIVER}-reg.sock"
        assert d.plugin.socket_path == sock and sock.exists() and reg_sock.exists()
        r = d.plugin.readiness()
        assert r.ready and "not yet registered" in r.detail
        probe = await d.identity.Probe(csi_pb2.ProbeRequest())
        assert probe.ready.value is True

        async with aio.insecure_channel(f"unix://{reg_sock}") as ch:  # kubelet's plugin watcher
            watcher = api_pb2_grpc.RegistrationStub(ch)
            info = await watcher.GetInfo(api_pb2.InfoRequest())
            assert (info.type, info.name, list(info.supported_versions)) == ("CSIPlugin", DRIVER, ["1.0.0"])
            assert info.endpoint == f"/var/lib/kubelet/plugins/{DRIVER}/csi.sock"  # the host path, not the root's
            # kubelet dials the endpoint as seen from the host; under a test root that is root + endpoint
            async with aio.insecure_channel(f"unix://{d.root}{info.endpoint}") as csi_ch:
                got = await csi_pb2_grpc.IdentityStub(csi_ch).GetPluginInfo(csi_pb2.GetPluginInfoRequest())
                assert got.name == DRIVER
            await watcher.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=False, error="no"))
            r = d.plugin.readiness()
            assert not r.ready and "rejected" in r.detail
            await watcher.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=True))
            r = d.plugin.readiness()
            assert r.ready and r.detail == "serving; registered with kubelet"

        await d.stop()
        assert not sock.exists() and not reg_sock.exists()
        assert not d.plugin.readiness().ready


async def test_node_info_and_capabilities() -> None:
    async with running_driver(Config(node_id="node-a", max_volumes_per_node=7)) as d:
        info = await d.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
        assert info.node_id == "node-a" and info.max_volumes_per_node == 7
        assert dict(info.accessible_topology.segments) == {"topology.local.csi.nodeplug.io/node": "node-a"}
        caps = await d.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest())
        R = csi_pb2.NodeServiceCapability.RPC
        assert {c.rpc.type for c in caps.capabilities} == {
            R.STAGE_UNSTAGE_VOLUME,
            R.GET_VOLUME_STATS,
            R.EXPAND_VOLUME,
            R.VOLUME_CONDITION,
            R.SINGLE_NODE_MULTI_WRITER,
        }


async def test_reload_with_a_changed_section_keeps_serving() -> None:
    async with running_driver(Config(node_id="before")) as d:
        assert d.plugin is not None
        await d.plugin.reload(Config(node_id="before"))  # unchanged: nothing happens
        await d.plugin.reload(Config(node_id="after"))
        assert d.plugin.readiness().ready
        async with aio.insecure_channel(f"unix://{d.plugin.socket_path}") as ch:
            info = await csi_pb2_grpc.NodeStub(ch).NodeGetInfo(csi_pb2.NodeGetInfoRequest())
        assert info.node_id == "after"


SERVE = """
import asyncio, sys
from pathlib import Path
from csi.config import Config
from csi.plugin import CsiPlugin
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

async def main():
    plugin = CsiPlugin(Config(), AgentContext(root=Root(Path(sys.argv[1]))))
    await plugin.start()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def spawn_driver(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


async def test_kill_9_while_published_then_restart_loses_nothing() -> None:
    root = Path(tempfile.mkdtemp(prefix="npcsi", dir="/tmp"))
    d = Driver(root, Config())
    proc = spawn_driver(root)
    try:
        async with aio.insecure_channel(f"unix://{root}/var/lib/kubelet/plugins/{DRIVER}/csi.sock") as ch:
            d.controller, d.node = csi_pb2_grpc.ControllerStub(ch), csi_pb2_grpc.NodeStub(ch)
            vid = (await d.create("pvc-kill")).volume_id
            await d.stage(vid)
            target = await d.publish(vid)
            (target / "f").write_bytes(b"durable")
        end(proc)  # SIGKILL: no stop(), the sockets stay behind
        proc = spawn_driver(root)  # removes the stale sockets and serves again
        async with aio.insecure_channel(f"unix://{root}/var/lib/kubelet/plugins/{DRIVER}/csi.sock") as ch:
            d.controller, d.node = csi_pb2_grpc.ControllerStub(ch), csi_pb2_grpc.NodeStub(ch)
            await d.stage(vid)  # kubelet's retries find everything as it was
            await d.publish(vid)
            assert (target / "f").read_bytes() == b"durable"
            await d.take_down(vid, target)
            assert d.mounts_under_root() == [] and d.loops_under_root() == []
    finally:
        end(proc)
        d.cleanup_host()
        shutil.rmtree(root, ignore_errors=True)
