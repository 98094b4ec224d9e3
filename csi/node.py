"""The CSI Node service: stage, publish, stats and expansion of this node's volumes.

Shape of every mutating RPC: validate the request (a missing or bad field is INVALID_ARGUMENT naming it; paths must be
absolute, free of ``..`` and, symlinks resolved, have the shape kubelet gives staging and target paths, and mount
flags must be acceptable: :mod:`csi.noderequests`), look the volume up (NOT_FOUND), take the
volume's operation lock (a second operation in flight is ABORTED), then do the host work in a worker thread
(``asyncio.to_thread``) so the event loop never blocks on mount, losetup or mkfs (resolving the request's paths
runs in a worker too). NodeGetVolumeStats and NodeExpandVolume only compare their path with the records, so any
other path is NOT_FOUND (:func:`lookup_path`).

Host truth over records. Whether something is mounted is read from ``/proc/self/mountinfo``, which loop device
backs a file from the kernel (:mod:`csi.loopdev`) and whether a mount is this volume's from the kernel too
(:mod:`csi.holders`), so every step is idempotent and re-runnable and never adopts or removes another volume's
mount: after a reboot the
loop devices and mounts are gone while the stage record remains, and the next NodeStageVolume simply re-attaches and
re-mounts. Records (stage, publish) say what kubelet asked for, so unstage/unpublish/stats know what to look at.

Publishing: a filesystem volume is bind-mounted from the staging path (read-only and per-mount flags by a bind
remount); a block volume's loop device node is bind-mounted onto a file at the target. A read-only block publish gets
its own read-only loop device (``losetup -r``) because a read-only bind mount of a device node does not stop writes
to the device; unpublish finds it again from the mount table and detaches it.

Compatibility of a repeat publish is judged against the host: same target, same read-only flag and the same per-mount
flags is OK, anything else ALREADY_EXISTS; a second target under a SINGLE_NODE_SINGLE_WRITER / SINGLE_NODE_WRITER /
SINGLE_NODE_READER_ONLY access mode is FAILED_PRECONDITION (spec table for plugins with SINGLE_NODE_MULTI_WRITER).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from csi import nodestats
from csi.config import TOPOLOGY_KEY, Config
from csi.errors import CsiError, FailedPrecondition, InvalidArgument
from csi.grpcerrors import Context, rpc
from csi.locks import OperationLocks
from csi.model import validate_id
from csi.nodehost import EPHEMERAL_KEY, NodeHost, PublishSpec, StageSpec
from csi.noderequests import (
    BLOCK_TARGET,
    MOUNT_TARGET,
    STAGING_SHAPES,
    TARGET_SHAPES,
    checked_flags,
    checked_path,
    lookup_path,
)
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc

T = TypeVar("T")
_Mode = csi_pb2.VolumeCapability.AccessMode
_NodeCap = csi_pb2.NodeServiceCapability.RPC
SINGLE_TARGET_MODES = frozenset(
    {_Mode.SINGLE_NODE_WRITER, _Mode.SINGLE_NODE_READER_ONLY, _Mode.SINGLE_NODE_SINGLE_WRITER}
)


if TYPE_CHECKING:  # lightkube is loaded only by an agent that follows an API server
    from csi.pvsize import PvSizes

CapabilityRequest = csi_pb2.NodeStageVolumeRequest | csi_pb2.NodePublishVolumeRequest | csi_pb2.NodeExpandVolumeRequest


def capability(request: CapabilityRequest, required: bool = True) -> tuple[str, str, tuple[str, ...], int]:
    """(access type "mount"/"block", fs type, mount flags, access mode) from the request's ``volume_capability``."""
    field = "volume_capability"
    if not request.HasField("volume_capability"):
        if required:
            raise InvalidArgument(f"{field}: required field is missing")
        return "", "", (), _Mode.UNKNOWN
    cap = request.volume_capability
    kind = cap.WhichOneof("access_type")
    if kind is None:
        raise InvalidArgument(f"{field}.access_type: expected mount or block")
    mode = cap.access_mode.mode if cap.HasField("access_mode") else _Mode.UNKNOWN
    if cap.HasField("access_mode") and mode == _Mode.UNKNOWN:
        raise InvalidArgument(f"{field}.access_mode.mode: expected a known access mode, got UNKNOWN")
    if kind == "block":
        return "block", "", (), mode
    return "mount", cap.mount.fs_type, checked_flags(cap.mount.mount_flags), mode


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(
        self,
        config: Config,
        host: NodeHost,
        locks: OperationLocks,
        kubelet_dir: Path,
        pv_sizes: PvSizes | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self.locks = locks
        self.kubelet_dir = kubelet_dir
        self.pv_sizes = pv_sizes  # with an API server: a claim grown while unused grows at stage (csi.pvsize)
        self.node_id = host.manager.node_id

    async def _locked(self, volume_id: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a worker thread holding the volume's lock there, so a cancelled RPC (the caller's deadline)
        cannot release the lock while the worker is still changing the host."""

        def locked() -> T:
            with self.locks.hold(f"volume/{volume_id}"):
                return fn()

        return await asyncio.to_thread(locked)

    async def _path(self, field: str, value: str, shapes: frozenset[str]) -> Path:
        """:func:`checked_path` in a worker thread: resolving symlinks is file I/O, kept off the event loop."""
        checked = await asyncio.to_thread(checked_path, field, value, self.kubelet_dir, shapes)
        assert checked is not None  # required
        return checked[0]

    # ------------------------------------------------------------ stage

    @rpc
    async def NodeStageVolume(
        self, request: csi_pb2.NodeStageVolumeRequest, context: Context
    ) -> csi_pb2.NodeStageVolumeResponse:
        volume_id = validate_id("volume_id", request.volume_id)
        staging = await self._path("staging_target_path", request.staging_target_path, STAGING_SHAPES)
        kind, fs_type, flags, _ = capability(request)
        spec = StageSpec(volume_id=volume_id, staging=staging, kind=kind, fs_type=fs_type, flags=flags)
        await self._grow_to_pv(volume_id)
        await self._locked(volume_id, lambda: self.host.stage(spec))
        return csi_pb2.NodeStageVolumeResponse()

    async def _grow_to_pv(self, volume_id: str) -> None:
        """Before staging a loop-file filesystem volume: grow its backing file to the size its PV now says, so the
        filesystem is grown before it is mounted (see csi.pvsize). Any failure leaves it to NodeExpandVolume."""
        if self.pv_sizes is None:
            return
        v = await asyncio.to_thread(self.host.volume, volume_id)
        if v.is_block or v.is_subvolume or v.ephemeral:
            return
        want = await self.pv_sizes.size(v.name, volume_id)
        if want is None or want <= v.capacity_bytes:
            return
        try:
            await asyncio.to_thread(self.host.manager.expand_volume, volume_id, want)
        except (CsiError, OSError) as e:
            self.host.log.warning("not grown at stage; NodeExpandVolume will", volume_id=volume_id, error=str(e))

    @rpc
    async def NodeUnstageVolume(
        self, request: csi_pb2.NodeUnstageVolumeRequest, context: Context
    ) -> csi_pb2.NodeUnstageVolumeResponse:
        volume_id = validate_id("volume_id", request.volume_id)
        staging = await self._path("staging_target_path", request.staging_target_path, STAGING_SHAPES)
        await self._locked(volume_id, lambda: self.host.unstage(volume_id, staging))
        return csi_pb2.NodeUnstageVolumeResponse()

    # ------------------------------------------------------------ publish

    @rpc
    async def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: Context
    ) -> csi_pb2.NodePublishVolumeResponse:
        volume_id = validate_id("volume_id", request.volume_id)
        if not request.target_path:
            raise InvalidArgument("target_path: required field is missing")
        kind, fs_type, flags, mode = capability(request)
        shape = frozenset({BLOCK_TARGET if kind == "block" else MOUNT_TARGET})
        target = await self._path("target_path", request.target_path, shape)
        context_map = dict(request.volume_context)
        ephemeral = context_map.get(EPHEMERAL_KEY, "").lower() == "true"
        staging: Path | None = None
        if request.staging_target_path:
            staging = await self._path("staging_target_path", request.staging_target_path, STAGING_SHAPES)
        elif not ephemeral:
            raise FailedPrecondition("staging_target_path: not set; the driver stages volumes, call NodeStageVolume")
        spec = PublishSpec(
            volume_id=volume_id,
            target=target,
            staging=staging,
            kind=kind,
            fs_type=fs_type,
            flags=flags,
            readonly=bool(request.readonly),
            single_target=mode in SINGLE_TARGET_MODES,
            ephemeral=ephemeral,
            context=context_map,
        )
        publish = self.host.publish_ephemeral if ephemeral else self.host.publish
        await self._locked(volume_id, lambda: publish(spec))
        return csi_pb2.NodePublishVolumeResponse()

    @rpc
    async def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: Context
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        volume_id = validate_id("volume_id", request.volume_id)
        target = await self._path("target_path", request.target_path, TARGET_SHAPES)

        def unpublish() -> None:
            ephemeral = self.host.ephemeral_of(volume_id)
            if ephemeral is not None:
                self.host.unpublish_ephemeral(ephemeral, target)
            else:
                self.host.unpublish(volume_id, target)

        await self._locked(volume_id, unpublish)
        return csi_pb2.NodeUnpublishVolumeResponse()

    # ------------------------------------------------------------ stats and expansion

    @rpc
    async def NodeGetVolumeStats(
        self, request: csi_pb2.NodeGetVolumeStatsRequest, context: Context
    ) -> csi_pb2.NodeGetVolumeStatsResponse:
        volume_id = validate_id("volume_id", request.volume_id)
        stats = await asyncio.to_thread(
            lambda: nodestats.stats(self.host, volume_id, lookup_path("volume_path", request.volume_path))
        )
        Unit = csi_pb2.VolumeUsage
        usage = []
        if stats.total_bytes is not None:
            if stats.fs is None:
                usage.append(Unit(unit=Unit.BYTES, total=stats.total_bytes))
            else:
                fs = stats.fs
                usage.append(
                    Unit(unit=Unit.BYTES, total=fs.total_bytes, used=fs.used_bytes, available=fs.available_bytes)
                )
                if fs.total_inodes:
                    usage.append(
                        Unit(unit=Unit.INODES, total=fs.total_inodes, used=fs.used_inodes, available=fs.free_inodes)
                    )
        cond = csi_pb2.VolumeCondition(abnormal=stats.problem is not None, message=stats.problem or "volume is healthy")
        return csi_pb2.NodeGetVolumeStatsResponse(usage=usage, volume_condition=cond)

    @rpc
    async def NodeExpandVolume(
        self, request: csi_pb2.NodeExpandVolumeRequest, context: Context
    ) -> csi_pb2.NodeExpandVolumeResponse:
        volume_id = validate_id("volume_id", request.volume_id)
        path = await asyncio.to_thread(lookup_path, "volume_path", request.volume_path)
        kind, _, _, _ = capability(request, required=False)
        required = request.capacity_range.required_bytes if request.HasField("capacity_range") else 0
        limit = request.capacity_range.limit_bytes if request.HasField("capacity_range") else 0
        if required < 0 or limit < 0 or (limit and required > limit):
            raise InvalidArgument("capacity_range: expected 0 <= required_bytes <= limit_bytes")
        # Expansion is node-only (see CONTROLLER_CAPABILITIES): the backing file or qgroup grows here first (never
        # shrinks; nothing to do when it already has the size), then the filesystem. The path is checked first: a
        # path the volume is not at is NOT_FOUND with nothing grown.

        def grow_backing() -> None:
            nodestats.where(self.host, self.host.volume(volume_id), path)
            if required:
                self.host.manager.expand_volume(volume_id, required, limit)

        await asyncio.to_thread(grow_backing)
        size = await self._locked(
            volume_id, lambda: nodestats.expand(self.host, volume_id, path, kind=kind, required=required)
        )
        return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)

    # ------------------------------------------------------------ info

    @rpc
    async def NodeGetCapabilities(
        self, request: csi_pb2.NodeGetCapabilitiesRequest, context: Context
    ) -> csi_pb2.NodeGetCapabilitiesResponse:
        caps = [
            _NodeCap.STAGE_UNSTAGE_VOLUME,
            _NodeCap.GET_VOLUME_STATS,
            _NodeCap.EXPAND_VOLUME,
            _NodeCap.VOLUME_CONDITION,
            _NodeCap.SINGLE_NODE_MULTI_WRITER,
        ]
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[csi_pb2.NodeServiceCapability(rpc=_NodeCap(type=t)) for t in caps]
        )

    @rpc
    async def NodeGetInfo(self, request: csi_pb2.NodeGetInfoRequest, context: Context) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(
            node_id=self.node_id,
            max_volumes_per_node=self.config.max_volumes_per_node,
            accessible_topology=csi_pb2.Topology(segments={TOPOLOGY_KEY: self.node_id}),
        )
