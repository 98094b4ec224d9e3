"""The CSI plugin on a temporary root, driven through its unix socket as kubelet and the CSI sidecars drive it.

:class:`Driver` is shared by the CSI e2e modules (``from test_csi_harness import Driver``): it starts the plugin with
``csi.plugin.create`` on a short temporary root (unix socket paths are limited to 107 bytes), talks to it with the
generated stubs over the real socket, lays out staging and target paths the way kubelet does, restarts the plugin on
the same root, and at teardown removes every mount and loop device left under the root even when a test failed.
The tests in this module are about the plugin itself: sockets, readiness, kubelet registration.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpc import aio

from csi.config import Config
from csi.plugin import CsiPlugin, create
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.api.pluginregistration.v1 import api_pb2, api_pb2_grpc
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")

DRIVER = "local.csi.nodeplug.io"
Cap = csi_pb2.VolumeCapability
MiB = 1 << 20


def cap(
    block: bool = False, fs: str = "", flags: tuple[str, ...] = (), mode: int = Cap.AccessMode.SINGLE_NODE_WRITER
) -> Any:
    if block:
        return Cap(block=Cap.BlockVolume(), access_mode=Cap.AccessMode(mode=mode))
    return Cap(mount=Cap.MountVolume(fs_type=fs, mount_flags=list(flags)), access_mode=Cap.AccessMode(mode=mode))


class Driver:
    def __init__(self, root: Path, config: Config) -> None:
        self.root = root
        self.config = config
        self.kubelet = root / "var" / "lib" / "kubelet"
        self.plugin: CsiPlugin | None = None
        self._channel: aio.Channel | None = None

    async def start(self) -> None:
        self.plugin = create(self.config, AgentContext(root=Root(self.root)))
        await self.plugin.start()
        self._channel = aio.insecure_channel(f"unix://{self.plugin.socket_path}")
        self.identity = csi_pb2_grpc.IdentityStub(self._channel)
        self.controller = csi_pb2_grpc.ControllerStub(self._channel)
        self.node = csi_pb2_grpc.NodeStub(self._channel)

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self.plugin is not None:
            await self.plugin.stop(1.0)

    async def restart(self, config: Config | None = None) -> None:
        await self.stop()
        self.config = config or self.config
        await self.start()

    # ------------------------------------------------------------ kubelet's layout

    def staging(self, volume_id: str) -> Path:
        p = self.kubelet / "plugins" / "kubernetes.io" / "csi" / DRIVER / volume_id / "globalmount"
        p.mkdir(parents=True, exist_ok=True)  # kubelet creates the staging directory
        return p

    def target(self, volume_id: str, pod: str = "pod1", block: bool = False) -> Path:
        if block:
            parent = self.kubelet / "plugins" / "kubernetes.io" / "csi" / "volumeDevices" / "publish" / volume_id
        else:
            parent = self.kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi" / volume_id
        parent.mkdir(parents=True, exist_ok=True)  # kubelet creates the parent, the driver the target
        return parent / (pod if block else "mount")

    # ------------------------------------------------------------ the calls, with defaults

    async def create(self, name: str, size: int = 64 * MiB, block: bool = False, fs: str = "", **params: str) -> Any:
        resp = await self.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=name,
                capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                volume_capabilities=[cap(block, fs)],
                parameters=params,
            )
        )
        return resp.volume

    async def stage(self, volume_id: str, block: bool = False, fs: str = "", flags: tuple[str, ...] = ()) -> Path:
        path = self.staging(volume_id)
        await self.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=volume_id, staging_target_path=str(path), volume_capability=cap(block, fs, flags)
            )
        )
        return path

    async def publish(
        self, volume_id: str, pod: str = "pod1", block: bool = False, readonly: bool = False, **kw: Any
    ) -> Path:
        target = self.target(volume_id, pod, block)
        await self.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id,
                staging_target_path=str(self.staging(volume_id)),
                target_path=str(target),
                volume_capability=kw.pop("capability", None) or cap(block, **kw),
                readonly=readonly,
            )
        )
        return target

    async def unpublish(self, volume_id: str, target: Path) -> None:
        await self.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        )

    async def unstage(self, volume_id: str) -> None:
        await self.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(self.staging(volume_id)))
        )

    async def delete(self, volume_id: str) -> None:
        await self.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id))

    async def stats(self, volume_id: str, path: Path) -> Any:
        return await self.node.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(path))
        )

    # ------------------------------------------------------------ host views

    def mounts_under_root(self) -> list[str]:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        return [p for p in points if p.startswith(str(self.root) + "/")]

    def loops_under_root(self) -> list[str]:
        out = subprocess.run(["losetup", "-J", "-l"], capture_output=True, text=True, check=False).stdout
        devs = json.loads(out).get("loopdevices", []) if out.strip() else []
        return [d["name"] for d in devs if str(d.get("back-file") or "").startswith(str(self.root) + "/")]

    def cleanup_host(self) -> None:
        for point in sorted(self.mounts_under_root(), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        for dev in self.loops_under_root():
            subprocess.run(["losetup", "-d", dev], capture_output=True, check=False)


@contextlib.asynccontextmanager
async def running_driver(config: Config | None = None, root: Path | None = None) -> AsyncIterator[Driver]:
    root = root or Path(tempfile.mkdtemp(prefix="npcsi", dir="/tmp"))
    d = Driver(root, config or Config())
    try:
        await d.start()
        yield d
    finally:
        with contextlib.suppress(Exception):
            await d.stop()
        d.cleanup_host()
        shutil.rmtree(root, ignore_errors=True)


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
from csi.plugin import create
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

async def main():
    plugin = create(Config(), AgentContext(root=Root(Path(sys.argv[1]))))
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
            await d.unpublish(vid, target)
            await d.unstage(vid)
            await d.delete(vid)
            assert d.mounts_under_root() == [] and d.loops_under_root() == []
    finally:
        end(proc)
        d.cleanup_host()
        shutil.rmtree(root, ignore_errors=True)
