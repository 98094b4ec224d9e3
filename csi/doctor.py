"""``nodeplug doctor`` checks for the CSI driver.

Node prerequisites: loop devices (``losetup`` and a free device), ``mkfs.ext4`` and ``mkfs.xfs`` on PATH, and, when the
btrfs backend is configured, the ``btrfs`` tool and a btrfs filesystem at the configured path.

End to end, when the agent is running: the check plays the external-provisioner and kubelet through the CSI socket —
CreateVolume (16 MiB), NodeStageVolume and NodePublishVolume at paths of kubelet's shapes under kubelet's directory
(named ``nodeplug-doctor-<random>``), write a file and read it back through the published path, then
NodeUnpublishVolume, NodeUnstageVolume and DeleteVolume. Whatever it created is torn down even when a step fails
(directories only while empty: never a recursive delete).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
from pathlib import Path

from grpc import aio

from csi.backends import fileops
from csi.config import Config
from csi.plugin import csi_socket_default, registration_socket_default
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.checks import Check, CheckFailed, CheckSkipped, dirs_check, tool_check
from nodeplug.commands import CommandError, arun
from nodeplug.paths import PLUGINS_DIR, PLUGINS_REGISTRY_DIR
from nodeplug.plugin import AgentContext

DOCTOR_BYTES = 16 << 20
RPC_TIMEOUT = 60.0


def _tool(name: str) -> Check:
    async def run() -> str:
        path = shutil.which(name)
        if path is None:
            raise CheckFailed(f"{name} not found on PATH: install it on the node")
        return path

    return Check("tools", name, run)


async def _loop_devices() -> str:
    if shutil.which("losetup") is None:
        raise CheckFailed("losetup not found on PATH: install util-linux")
    if not await asyncio.to_thread(os.path.exists, "/dev/loop-control"):
        raise CheckFailed("/dev/loop-control is missing: load the loop module (modprobe loop)")
    try:
        dev = (await arun(["losetup", "-f"], 10)).strip()
    except CommandError as e:
        raise CheckFailed(f"no free loop device: {e}") from e
    return f"next free loop device {dev}"


def _btrfs(config: Config, ctx: AgentContext) -> Check:
    async def run() -> str:
        if not config.btrfs.enabled:
            raise CheckSkipped("btrfs backend not enabled")
        if shutil.which("btrfs") is None:
            raise CheckFailed("btrfs not found on PATH: install btrfs-progs")
        path = ctx.root(config.btrfs.path)
        try:
            fstype = (await arun(["findmnt", "-n", "-o", "FSTYPE", "-T", str(path)], 10)).strip()
        except CommandError as e:
            raise CheckFailed(f"cannot find the filesystem at {path}: {e}") from e
        if fstype != "btrfs":
            raise CheckFailed(
                f"{path} is on {fstype or 'no filesystem'}, not btrfs: set csi.btrfs.path to a btrfs mount"
            )
        return f"btrfs at {path}"

    return Check("csi", "btrfs backend", run)


def _cap() -> csi_pb2.VolumeCapability:
    Cap = csi_pb2.VolumeCapability
    return Cap(
        mount=Cap.MountVolume(fs_type="ext4"), access_mode=Cap.AccessMode(mode=Cap.AccessMode.SINGLE_NODE_WRITER)
    )


async def _lifecycle(config: Config, ctx: AgentContext) -> str:
    sock = ctx.root(csi_socket_default(config.driver_name))
    if not sock.exists():
        raise CheckSkipped(f"the agent is not running (no socket at {sock})")
    tag = secrets.token_hex(4)
    name = f"nodeplug-doctor-{tag}"
    kubelet = ctx.root(config.kubelet_dir)
    # where kubelet would stage and publish it (the driver accepts kubelet's shapes only)
    staging = kubelet / "plugins/kubernetes.io/csi" / config.driver_name / name / "globalmount"
    target = kubelet / "pods" / name / "volumes/kubernetes.io~csi" / name / "mount"
    made = await asyncio.to_thread(lambda: fileops.make_dirs(staging) + fileops.make_dirs(target.parent))
    volume_id = ""
    stage_done = publish_done = False
    async with aio.insecure_channel(f"unix://{sock}") as ch:
        ident, ctl, node = csi_pb2_grpc.IdentityStub(ch), csi_pb2_grpc.ControllerStub(ch), csi_pb2_grpc.NodeStub(ch)
        try:
            probe = await ident.Probe(csi_pb2.ProbeRequest(), timeout=RPC_TIMEOUT)
            if not probe.ready.value:
                raise CheckFailed("the driver answers Probe with ready=false")
            created = await ctl.CreateVolume(
                csi_pb2.CreateVolumeRequest(
                    name=name,
                    capacity_range=csi_pb2.CapacityRange(required_bytes=DOCTOR_BYTES),
                    volume_capabilities=[_cap()],
                ),
                timeout=RPC_TIMEOUT,
            )
            volume_id = created.volume.volume_id
            await node.NodeStageVolume(
                csi_pb2.NodeStageVolumeRequest(
                    volume_id=volume_id, staging_target_path=str(staging), volume_capability=_cap()
                ),
                timeout=RPC_TIMEOUT,
            )
            stage_done = True
            await node.NodePublishVolume(
                csi_pb2.NodePublishVolumeRequest(
                    volume_id=volume_id,
                    staging_target_path=str(staging),
                    target_path=str(target),
                    volume_capability=_cap(),
                ),
                timeout=RPC_TIMEOUT,
            )
            publish_done = True
            payload = secrets.token_bytes(4096)
            await asyncio.to_thread(_write_read, target / "doctor.bin", payload)
            await node.NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target)), timeout=RPC_TIMEOUT
            )
            publish_done = False
            await node.NodeUnstageVolume(
                csi_pb2.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(staging)),
                timeout=RPC_TIMEOUT,
            )
            stage_done = False
            await ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id), timeout=RPC_TIMEOUT)
            volume_id = ""
        except aio.AioRpcError as e:
            raise CheckFailed(f"{e.code().name}: {e.details()}") from e
        finally:
            await _cleanup(
                ch,
                volume_id=volume_id,
                staging=staging,
                target=target,
                stage_done=stage_done,
                publish_done=publish_done,
            )
            await asyncio.to_thread(fileops.remove_dirs, made)
    return f"created, staged, published, wrote and read back 4 KiB, tore down a {DOCTOR_BYTES >> 20} MiB volume"


def _write_read(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    if path.read_bytes() != payload:
        raise CheckFailed(f"read back different bytes from {path}")


async def _cleanup(
    ch: aio.Channel,
    *,
    volume_id: str,
    staging: Path,
    target: Path,
    stage_done: bool,
    publish_done: bool,
) -> None:
    node, ctl = csi_pb2_grpc.NodeStub(ch), csi_pb2_grpc.ControllerStub(ch)
    if not volume_id:
        return
    with contextlib.suppress(aio.AioRpcError):
        if publish_done:
            await node.NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target)), timeout=RPC_TIMEOUT
            )
        if stage_done:
            await node.NodeUnstageVolume(
                csi_pb2.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(staging)),
                timeout=RPC_TIMEOUT,
            )
        await ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id), timeout=RPC_TIMEOUT)


def checks(section: Config, ctx: AgentContext) -> list[Check]:
    async def registration() -> str:
        sock = ctx.root(registration_socket_default(section.driver_name))
        if not ctx.root(csi_socket_default(section.driver_name)).exists():
            raise CheckSkipped("the agent is not running")
        if not section.registration_enabled:
            raise CheckSkipped("kubelet registration disabled in the config")
        if not sock.exists():
            raise CheckFailed(f"registration socket {sock} is missing: kubelet cannot find the driver")
        return str(sock)

    async def lifecycle() -> str:
        return await _lifecycle(section, ctx)

    async def filesystems() -> str:
        with open("/proc/filesystems") as f:  # noqa: ASYNC230 (procfs, never blocks)
            have = {line.split()[-1] for line in f if line.strip()}
        want = ["ext4", "xfs"] + (["btrfs"] if section.btrfs.enabled else [])
        missing = [fs for fs in want if fs not in have]
        if missing:
            # a module may still be loadable on first mount; say so instead of failing outright
            return f"{', '.join(want)} wanted; not yet registered: {', '.join(missing)} (loaded on first mount)"
        return ", ".join(want)

    tools = ["losetup", "mount", "umount", "resize2fs", "xfs_growfs", "fsfreeze"]
    if section.btrfs.enabled:
        tools.append("btrfs")
    kubelet_dirs = [ctx.root(PLUGINS_DIR), ctx.root(PLUGINS_REGISTRY_DIR)]
    return [
        Check("kernel", "filesystems", filesystems),
        *(tool_check("tools", t) for t in tools),
        dirs_check("kubelet", "plugins directories", kubelet_dirs, ctx.root.path),
        Check("kernel", "loop devices", _loop_devices),
        _tool("mkfs.ext4"),
        _tool("mkfs.xfs"),
        _btrfs(section, ctx),
        Check("csi", "registration socket", registration),
        Check("csi", "volume lifecycle", lifecycle),
    ]
