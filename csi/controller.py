"""The CSI Controller service: a thin grpc.aio servicer over :class:`csi.volumes.VolumeManager`.

Each method validates its request (a missing or bad field is INVALID_ARGUMENT naming it), calls the manager in a
worker thread (``asyncio.to_thread``: mkfs, cp and btrfs block) and translates the result into csi.v1 messages.
Domain errors become status codes in one place, :func:`csi.grpcerrors.rpc`. Constructed by the plugin as
``ControllerServicer(manager)``.

Supported: single-node access modes only (SINGLE_NODE_WRITER, _READER_ONLY, _SINGLE_WRITER, _MULTI_WRITER) on mount
or block volumes; MULTI_NODE_* is INVALID_ARGUMENT because a node-local volume cannot be reached from another node.
Volumes live on this node only: every volume reports ``topology.local.csi.nodeplug.io/node=<node id>`` and a
topology requirement that excludes this node is RESOURCE_EXHAUSTED. There is no ControllerPublish step (kubelet
stages straight from the node), so ControllerPublish/Unpublish and ControllerModifyVolume are UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from google.protobuf import timestamp_pb2, wrappers_pb2
from grpc import aio

from csi.config import TOPOLOGY_KEY
from csi.errors import InvalidArgument, ResourceExhausted, Unimplemented
from csi.grpcerrors import rpc
from csi.model import Condition, Snapshot, Volume, VolumeSource
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc

_Mode = csi_pb2.VolumeCapability.AccessMode
_Cap = csi_pb2.ControllerServiceCapability.RPC
SUPPORTED_MODES = frozenset(
    {
        _Mode.SINGLE_NODE_WRITER,
        _Mode.SINGLE_NODE_READER_ONLY,
        _Mode.SINGLE_NODE_SINGLE_WRITER,
        _Mode.SINGLE_NODE_MULTI_WRITER,
    }
)
# No EXPAND_VOLUME: expansion is node-only. Volumes live on one node, and external-resizer (one per cluster, or one
# per node each offering every claim to its own agent) cannot tell which node's agent holds a volume; without the
# capability it records the new size itself and kubelet, on the volume's node, calls NodeExpandVolume, which grows
# the backing file or qgroup and then the filesystem. ControllerExpandVolume still answers callers that call it.
CONTROLLER_CAPABILITIES = (
    _Cap.CREATE_DELETE_VOLUME,
    _Cap.LIST_VOLUMES,
    _Cap.GET_CAPACITY,
    _Cap.CREATE_DELETE_SNAPSHOT,
    _Cap.LIST_SNAPSHOTS,
    _Cap.CLONE_VOLUME,
    _Cap.GET_VOLUME,
    _Cap.GET_SNAPSHOT,
    _Cap.VOLUME_CONDITION,
    _Cap.SINGLE_NODE_MULTI_WRITER,
    _Cap.PUBLISH_READONLY,
)


def required(field: str, value: Any) -> None:
    if not value:
        raise InvalidArgument(f"{field}: required field is missing")


def parse_capabilities(caps: Iterable[Any], field: str = "volume_capabilities") -> tuple[str, str]:
    """(access type, fs type) that every capability in ``caps`` agrees on; INVALID_ARGUMENT naming the culprit."""
    caps = list(caps)
    required(field, caps)
    kinds, fs_types = set(), set()
    for i, cap in enumerate(caps):
        kind = cap.WhichOneof("access_type")
        if kind is None:
            raise InvalidArgument(f"{field}[{i}].access_type: expected mount or block")
        mode = cap.access_mode.mode
        if mode not in SUPPORTED_MODES:
            name = _Mode.Mode.Name(mode) if mode in _Mode.Mode.values() else str(mode)
            raise InvalidArgument(
                f"{field}[{i}].access_mode.mode: expected a single-node mode (this driver's volumes are local to one "
                f"node), got {name}"
            )
        kinds.add(kind)
        if kind == "mount" and cap.mount.fs_type:
            fs_types.add(cap.mount.fs_type)
    if len(kinds) > 1:
        raise InvalidArgument(f"{field}: mixes mount and block access types")
    if len(fs_types) > 1:
        raise InvalidArgument(f"{field}: asks for different filesystem types {sorted(fs_types)}")
    kind = kinds.pop()
    return kind, (fs_types.pop() if fs_types and kind == "mount" else "")


def _timestamp(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def snapshot_message(s: Snapshot) -> Any:
    return csi_pb2.Snapshot(
        size_bytes=s.size_bytes,
        snapshot_id=s.snapshot_id,
        source_volume_id=s.source_volume_id,
        creation_time=_timestamp(s.created_at),
        ready_to_use=s.ready_to_use,
        group_snapshot_id=s.group_snapshot_id,
    )


class ControllerServicer(csi_pb2_grpc.ControllerServicer):
    def __init__(self, manager: VolumeManager) -> None:
        self.manager = manager

    # ------------------------------------------------------------ helpers

    def _topology(self) -> Any:
        return csi_pb2.Topology(segments=self.manager.topology)

    def _volume_message(self, v: Volume) -> Any:
        src = None
        if v.source_snapshot_id:
            src = csi_pb2.VolumeContentSource(
                snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=v.source_snapshot_id)
            )
        elif v.source_volume_id:
            src = csi_pb2.VolumeContentSource(
                volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=v.source_volume_id)
            )
        return csi_pb2.Volume(
            capacity_bytes=v.capacity_bytes,
            volume_id=v.volume_id,
            volume_context={"backend": v.backend, "accessType": v.access_type, "fsType": v.fs_type},
            content_source=src,
            accessible_topology=[self._topology()],
        )

    def _check_topology(self, req: Any) -> None:
        """RESOURCE_EXHAUSTED when the requisite topologies all exclude this node.

        Preferred topologies alone do not bind: without a requisite list the spec lets the plugin choose any
        topology it can serve, and this node is the only one it can.
        """
        if not req.HasField("accessibility_requirements"):
            return
        wanted = list(req.accessibility_requirements.requisite)
        if not wanted:
            return
        ours = self.manager.topology
        if any(dict(t.segments) == ours for t in wanted):
            return
        raise ResourceExhausted(
            f"accessibility_requirements: this node ({TOPOLOGY_KEY}={self.manager.node_id}) is not among the "
            f"requested topologies {[dict(t.segments) for t in wanted][:4]}"
        )

    @staticmethod
    def _source(req: Any) -> VolumeSource | None:
        if not req.HasField("volume_content_source"):
            return None
        cs = req.volume_content_source
        kind = cs.WhichOneof("type")
        if kind == "snapshot":
            required("volume_content_source.snapshot.snapshot_id", cs.snapshot.snapshot_id)
            return VolumeSource("snapshot", cs.snapshot.snapshot_id)
        if kind == "volume":
            required("volume_content_source.volume.volume_id", cs.volume.volume_id)
            return VolumeSource("volume", cs.volume.volume_id)
        raise InvalidArgument("volume_content_source: expected a snapshot or a volume source")

    # ------------------------------------------------------------ volumes

    @rpc
    async def CreateVolume(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("name", request.name)
        access_type, fs_type = parse_capabilities(request.volume_capabilities)
        self._check_topology(request)
        source = self._source(request)
        cr = request.capacity_range
        v = await asyncio.to_thread(
            self.manager.create_volume,
            request.name,
            CapacityRange(cr.required_bytes, cr.limit_bytes),
            access_type,
            fs_type,
            "",
            dict(request.parameters),
            source,
        )
        return csi_pb2.CreateVolumeResponse(volume=self._volume_message(v))

    @rpc
    async def DeleteVolume(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("volume_id", request.volume_id)
        await asyncio.to_thread(self.manager.delete_volume, request.volume_id)
        return csi_pb2.DeleteVolumeResponse()

    @rpc
    async def ControllerPublishVolume(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        raise Unimplemented("ControllerPublishVolume: not supported (no PUBLISH_UNPUBLISH_VOLUME capability)")

    @rpc
    async def ControllerUnpublishVolume(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        raise Unimplemented("ControllerUnpublishVolume: not supported (no PUBLISH_UNPUBLISH_VOLUME capability)")

    @rpc
    async def ValidateVolumeCapabilities(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("volume_id", request.volume_id)
        required("volume_capabilities", list(request.volume_capabilities))
        v = await asyncio.to_thread(self.manager.get_volume, request.volume_id)
        try:
            access_type, fs_type = parse_capabilities(request.volume_capabilities)
        except InvalidArgument as e:
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message=str(e))
        problem = ""
        backend = request.parameters.get("backend", "")
        if backend and backend != v.backend:
            problem = f"volume {v.volume_id} is on the {v.backend} backend, not {backend}"
        elif access_type != v.access_type:
            problem = f"volume {v.volume_id} is a {v.access_type} volume, not {access_type}"
        elif fs_type and fs_type != v.fs_type:
            problem = f"volume {v.volume_id} holds {v.fs_type}, not {fs_type}"
        if problem:
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message=problem)
        confirmed = csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context,
            volume_capabilities=request.volume_capabilities,
            parameters=request.parameters,
        )
        return csi_pb2.ValidateVolumeCapabilitiesResponse(confirmed=confirmed)

    @rpc
    async def ListVolumes(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        def page() -> tuple[list[tuple[Volume, Condition]], str]:
            vols, token = self.manager.list_volumes(request.max_entries, request.starting_token)
            return [(v, self.manager.volume_condition(v.volume_id, quick=True)) for v in vols], token

        rows, token = await asyncio.to_thread(page)
        entries = [
            csi_pb2.ListVolumesResponse.Entry(
                volume=self._volume_message(v),
                status=csi_pb2.ListVolumesResponse.VolumeStatus(
                    volume_condition=csi_pb2.VolumeCondition(abnormal=c.abnormal, message=c.message)
                ),
            )
            for v, c in rows
        ]
        return csi_pb2.ListVolumesResponse(entries=entries, next_token=token)

    @rpc
    async def GetCapacity(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        if list(request.volume_capabilities):
            try:
                parse_capabilities(request.volume_capabilities)
            except InvalidArgument:
                return csi_pb2.GetCapacityResponse(available_capacity=0)
        topology = dict(request.accessible_topology.segments) if request.HasField("accessible_topology") else None
        free = await asyncio.to_thread(self.manager.get_capacity, dict(request.parameters), topology)
        return csi_pb2.GetCapacityResponse(
            available_capacity=free,
            maximum_volume_size=wrappers_pb2.Int64Value(value=free),
            minimum_volume_size=wrappers_pb2.Int64Value(value=1 << 20),
        )

    @rpc
    async def ControllerGetCapabilities(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        caps = [csi_pb2.ControllerServiceCapability(rpc=_Cap(type=t)) for t in CONTROLLER_CAPABILITIES]
        return csi_pb2.ControllerGetCapabilitiesResponse(capabilities=caps)

    @rpc
    async def ControllerExpandVolume(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("volume_id", request.volume_id)
        if not request.HasField("capacity_range"):
            raise InvalidArgument("capacity_range: required field is missing")
        if request.HasField("volume_capability"):
            v = await asyncio.to_thread(self.manager.get_volume, request.volume_id)
            access_type, fs_type = parse_capabilities([request.volume_capability], "volume_capability")
            if access_type != v.access_type or (fs_type and fs_type != v.fs_type):
                raise InvalidArgument(
                    f"volume_capability: volume {v.volume_id} is {v.access_type} {v.fs_type}, got {access_type} "
                    f"{fs_type}"
                )
        cr = request.capacity_range
        size, node = await asyncio.to_thread(
            self.manager.expand_volume, request.volume_id, cr.required_bytes, cr.limit_bytes
        )
        return csi_pb2.ControllerExpandVolumeResponse(capacity_bytes=size, node_expansion_required=node)

    @rpc
    async def ControllerGetVolume(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("volume_id", request.volume_id)
        v, cond = await asyncio.to_thread(
            lambda: (self.manager.get_volume(request.volume_id), self.manager.volume_condition(request.volume_id))
        )
        status = csi_pb2.ControllerGetVolumeResponse.VolumeStatus(
            volume_condition=csi_pb2.VolumeCondition(abnormal=cond.abnormal, message=cond.message)
        )
        return csi_pb2.ControllerGetVolumeResponse(volume=self._volume_message(v), status=status)

    @rpc
    async def ControllerModifyVolume(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        raise Unimplemented("ControllerModifyVolume: not supported (no MODIFY_VOLUME capability)")

    # ------------------------------------------------------------ snapshots

    @rpc
    async def CreateSnapshot(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("name", request.name)
        required("source_volume_id", request.source_volume_id)
        s = await asyncio.to_thread(
            self.manager.create_snapshot, request.name, request.source_volume_id, dict(request.parameters)
        )
        return csi_pb2.CreateSnapshotResponse(snapshot=snapshot_message(s))

    @rpc
    async def DeleteSnapshot(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("snapshot_id", request.snapshot_id)
        await asyncio.to_thread(self.manager.delete_snapshot, request.snapshot_id)
        return csi_pb2.DeleteSnapshotResponse()

    @rpc
    async def ListSnapshots(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        snaps, token = await asyncio.to_thread(
            self.manager.list_snapshots,
            request.max_entries,
            request.starting_token,
            request.source_volume_id,
            request.snapshot_id,
        )
        entries = [csi_pb2.ListSnapshotsResponse.Entry(snapshot=snapshot_message(s)) for s in snaps]
        return csi_pb2.ListSnapshotsResponse(entries=entries, next_token=token)

    @rpc
    async def GetSnapshot(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        required("snapshot_id", request.snapshot_id)
        s = await asyncio.to_thread(self.manager.get_snapshot, request.snapshot_id)
        return csi_pb2.GetSnapshotResponse(snapshot=snapshot_message(s))
