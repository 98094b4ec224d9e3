"""The CSI plugin on a temporary root, driven through its unix socket as kubelet and the CSI sidecars drive it.

Shared by the CSI tests: its fixture ``csi_driver`` (tests/conftest.py registers this module as a plugin), or
:func:`running_driver` for a root or config of their own. :class:`Driver` starts the plugin with
``csi.plugin.CsiPlugin`` on a short temporary root (unix socket paths are limited to 107 bytes), talks to it with the
generated stubs over the real socket, lays out staging and target paths in kubelet's shapes, restarts the plugin on
the same root, and at teardown removes every mount and loop device left under the root even when a test failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from csi.config import Config
from csi.plugin import CsiPlugin
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

from support.host import sh

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
        self.plugin = CsiPlugin(self.config, AgentContext(root=Root(self.root)))
        await self.plugin.start()
        self.connect(self.plugin.socket_path)

    def connect(self, socket: Path) -> None:
        """Talk to the driver at ``socket`` (this one's, or a whole agent's on the same root)."""
        self._channel = aio.insecure_channel(f"unix://{socket}")
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

    async def take_down(self, volume_id: str, target: Path) -> None:
        """What happens when the pod and then its claim go: unpublish from ``target``, unstage, delete."""
        await self.unpublish(volume_id, target)
        await self.unstage(volume_id)
        await self.delete(volume_id)

    async def stats(self, volume_id: str, path: Path) -> Any:
        return await self.node.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(path))
        )

    # ------------------------------------------------------------ host views

    def mounts_under_root(self) -> list[str]:
        return mounts_under(self.root)

    def loops_under_root(self) -> list[str]:
        return loops_under(self.root)

    def cleanup_host(self) -> None:
        cleanup_under(self.root)


def mounts_under(root: Path) -> list[str]:
    """Mount points below ``root``."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(str(root) + "/")]


def loops_under(root: Path) -> list[str]:
    """Loop devices whose backing file is below ``root``."""
    out = subprocess.run(["losetup", "-J", "-l"], capture_output=True, text=True, check=False).stdout
    devs = json.loads(out).get("loopdevices", []) if out.strip() else []
    return [d["name"] for d in devs if str(d.get("back-file") or "").startswith(str(root) + "/")]


def cleanup_under(root: Path) -> None:
    """Unmount everything below ``root`` (deepest first, no umount helpers) and detach the loop devices over files
    below it: what a failed test may leave."""
    for point in sorted(mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", "-i", point], capture_output=True, check=False)
    for dev in loops_under(root):
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


async def expect(call: Any, code: grpc.StatusCode, *needles: str) -> str:
    """Await ``call``, which must fail with ``code`` and a message containing every needle; return the message."""
    with pytest.raises(aio.AioRpcError) as e:
        await call
    assert e.value.code() == code, e.value.details()
    details = e.value.details() or ""
    for needle in needles:
        assert needle in details, details
    return details


@pytest.fixture
async def csi_driver() -> AsyncIterator[Driver]:
    """The CSI plugin with its default config on a fresh temporary root, served on its real socket; everything it
    mounted or attached under the root is removed at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the CSI driver creates loop devices and mounts")
    async with running_driver() as d:
        yield d


@pytest.fixture
def btrfs_root(loop_device: Callable[[int], str]) -> Iterator[Path]:
    """An agent root (short, under /tmp) whose ``/mnt/btrfs`` is a fresh btrfs filesystem on a loop device of the
    test's own (the configured btrfs path is a host path, read through the agent's root); unmounted and removed
    after the test."""
    dev = loop_device(512 * MiB)
    sh("mkfs.btrfs", "-q", "-f", dev)
    root = Path(tempfile.mkdtemp(prefix="npcsi", dir="/tmp"))
    mnt = root / "mnt" / "btrfs"
    mnt.mkdir(parents=True)
    sh("mount", dev, str(mnt))
    try:
        yield root
    finally:
        cleanup_under(root)  # the btrfs mount, and whatever a failed test left mounted or attached below root
        shutil.rmtree(root, ignore_errors=True)
