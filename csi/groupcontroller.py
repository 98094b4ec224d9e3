"""The CSI GroupController service: group snapshots over :class:`csi.volumes.VolumeManager`.

A group snapshot freezes every staged ext4/xfs member, copies them all, then thaws, so the members are write-order
consistent with each other; volumes that cannot be frozen while in use (staged block volumes, staged btrfs
subvolumes) make a multi-volume group FAILED_PRECONDITION, as the spec's error table asks. Get and Delete answer by
the group id first, as the reference driver does (an unknown group is NOT_FOUND, or already deleted), and check the
request's member list only against a group that exists. Constructed by the plugin as
``GroupControllerServicer(manager)``.
"""

from __future__ import annotations

import asyncio

from csi.controller import _timestamp, required, snapshot_message
from csi.grpcerrors import Context, rpc
from csi.model import GroupSnapshot, Snapshot
from csi.volumes import VolumeManager
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc

_Cap = csi_pb2.GroupControllerServiceCapability.RPC


def group_message(g: GroupSnapshot, members: list[Snapshot]) -> csi_pb2.VolumeGroupSnapshot:
    return csi_pb2.VolumeGroupSnapshot(
        group_snapshot_id=g.group_snapshot_id,
        snapshots=[snapshot_message(s) for s in members],
        creation_time=_timestamp(g.created_at),
        ready_to_use=g.ready_to_use and all(s.ready_to_use for s in members),
    )


class GroupControllerServicer(csi_pb2_grpc.GroupControllerServicer):
    def __init__(self, manager: VolumeManager) -> None:
        self.manager = manager

    @rpc
    async def GroupControllerGetCapabilities(
        self, request: csi_pb2.GroupControllerGetCapabilitiesRequest, context: Context
    ) -> csi_pb2.GroupControllerGetCapabilitiesResponse:
        cap = csi_pb2.GroupControllerServiceCapability(rpc=_Cap(type=_Cap.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT))
        return csi_pb2.GroupControllerGetCapabilitiesResponse(capabilities=[cap])

    @rpc
    async def CreateVolumeGroupSnapshot(
        self, request: csi_pb2.CreateVolumeGroupSnapshotRequest, context: Context
    ) -> csi_pb2.CreateVolumeGroupSnapshotResponse:
        required("name", request.name)
        required("source_volume_ids", list(request.source_volume_ids))
        g, members = await asyncio.to_thread(
            self.manager.snapshots.create_group_snapshot,
            request.name,
            list(request.source_volume_ids),
            dict(request.parameters),
        )
        return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=group_message(g, members))

    @rpc
    async def DeleteVolumeGroupSnapshot(
        self, request: csi_pb2.DeleteVolumeGroupSnapshotRequest, context: Context
    ) -> csi_pb2.DeleteVolumeGroupSnapshotResponse:
        required("group_snapshot_id", request.group_snapshot_id)  # snapshot_ids: checked once the group is found
        await asyncio.to_thread(
            self.manager.snapshots.delete_group_snapshot, request.group_snapshot_id, list(request.snapshot_ids)
        )
        return csi_pb2.DeleteVolumeGroupSnapshotResponse()

    @rpc
    async def GetVolumeGroupSnapshot(
        self, request: csi_pb2.GetVolumeGroupSnapshotRequest, context: Context
    ) -> csi_pb2.GetVolumeGroupSnapshotResponse:
        required("group_snapshot_id", request.group_snapshot_id)  # snapshot_ids: checked once the group is found
        g, members = await asyncio.to_thread(
            self.manager.snapshots.get_group_snapshot, request.group_snapshot_id, list(request.snapshot_ids)
        )
        return csi_pb2.GetVolumeGroupSnapshotResponse(group_snapshot=group_message(g, members))
