"""GroupController conformance: create/get/delete group snapshots per the spec's tables (loop-file volumes)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from csi.model import StageRecord
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc

from support.csicontroller import MIB, ControllerEnv, gone
from support.csidriver import expect


@dataclass
class Env:
    stub: csi_pb2_grpc.GroupControllerStub
    snaps: csi_pb2_grpc.ControllerStub
    manager: VolumeManager


@pytest.fixture
def env(ctl: ControllerEnv) -> Env:
    return Env(ctl.groups, ctl.stub, ctl.manager)


def volumes(m: VolumeManager, n: int, access: str = "mount") -> list[str]:
    return [
        m.create_volume(f"gv{i}-{access}", capacity_range=CapacityRange(4 * MIB), access_type=access).volume_id
        for i in range(n)
    ]


async def test_capabilities(env: Env) -> None:
    resp = await env.stub.GroupControllerGetCapabilities(csi_pb2.GroupControllerGetCapabilitiesRequest())
    assert [c.rpc.type for c in resp.capabilities] == [
        csi_pb2.GroupControllerServiceCapability.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT
    ]


async def test_group_snapshot_lifecycle(env: Env) -> None:
    ids = volumes(env.manager, 3)
    C = csi_pb2.CreateVolumeGroupSnapshotRequest
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(env.stub.CreateVolumeGroupSnapshot(C(source_volume_ids=ids)), bad, "name")
    await expect(env.stub.CreateVolumeGroupSnapshot(C(name="g")), bad, "source_volume_ids")
    await expect(
        env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=["vol-x"])), grpc.StatusCode.NOT_FOUND
    )
    g = (await env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids))).group_snapshot
    assert g.ready_to_use and len(g.snapshots) == 3
    assert {s.source_volume_id for s in g.snapshots} == set(ids)
    assert all(s.group_snapshot_id == g.group_snapshot_id for s in g.snapshots)
    again = (await env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids[::-1]))).group_snapshot
    assert again.group_snapshot_id == g.group_snapshot_id
    await expect(
        env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids[:2])), grpc.StatusCode.ALREADY_EXISTS
    )
    member_ids = [s.snapshot_id for s in g.snapshots]

    G = csi_pb2.GetVolumeGroupSnapshotRequest
    got = await env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids))
    assert {s.snapshot_id for s in got.group_snapshot.snapshots} == set(member_ids)
    await expect(env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id)), bad, "snapshot_ids")
    await expect(
        env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids[:1])),
        bad,
        "snapshot_ids",
    )
    # a member snapshot is usable alone, but only deleted with its group
    listed = await env.snaps.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=member_ids[0]))
    assert listed.entries[0].snapshot.group_snapshot_id == g.group_snapshot_id
    await expect(
        env.snaps.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=member_ids[0])),
        grpc.StatusCode.FAILED_PRECONDITION,
        "group",
    )

    D = csi_pb2.DeleteVolumeGroupSnapshotRequest
    await expect(env.stub.DeleteVolumeGroupSnapshot(D(snapshot_ids=member_ids)), bad, "group_snapshot_id")
    await expect(
        env.stub.DeleteVolumeGroupSnapshot(D(group_snapshot_id=g.group_snapshot_id, snapshot_ids=["snap-1"])),
        bad,
        "snapshot_ids",
    )
    paths = [env.manager.snapshots.get_snapshot(i).path for i in member_ids]
    await env.stub.DeleteVolumeGroupSnapshot(D(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids))
    assert all(gone(p) for p in paths)
    await env.stub.DeleteVolumeGroupSnapshot(D(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids))
    await expect(
        env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids)),
        grpc.StatusCode.NOT_FOUND,
    )
    assert not (await env.snaps.ListSnapshots(csi_pb2.ListSnapshotsRequest())).entries


async def test_group_of_staged_block_volumes_cannot_be_consistent(env: Env) -> None:
    ids = volumes(env.manager, 2, "block")
    env.manager.store.put_stage(StageRecord(ids[0], "/var/lib/kubelet/staging/x", "/dev/loop9"))
    C = csi_pb2.CreateVolumeGroupSnapshotRequest
    await expect(
        env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "cannot be frozen",
    )
    # alone it is fine (crash-consistent), and nothing was left behind by the refused group
    one = await env.stub.CreateVolumeGroupSnapshot(C(name="g1", source_volume_ids=ids[:1]))
    assert len(one.group_snapshot.snapshots) == 1
    assert len((await env.snaps.ListSnapshots(csi_pb2.ListSnapshotsRequest())).entries) == 1


async def test_group_busy_volume_is_aborted(env: Env) -> None:
    ids = volumes(env.manager, 2)
    with env.manager.locks.hold(f"volume/{ids[1]}"):
        await expect(
            env.stub.CreateVolumeGroupSnapshot(
                csi_pb2.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=ids)
            ),
            grpc.StatusCode.ABORTED,
        )
    assert not (await env.snaps.ListSnapshots(csi_pb2.ListSnapshotsRequest())).entries


@pytest.mark.parametrize("group_id", ["group-00000000000000000000000000000000", "invalid-id", "../x"])
async def test_an_unknown_group_is_answered_by_its_id_first(env: Env, group_id: str) -> None:
    """As the reference driver and csi-sanity have it: a group that does not exist is NOT_FOUND for Get and already
    deleted for Delete, whether or not snapshot_ids were sent; the member list is checked against a group that is."""
    await expect(
        env.stub.GetVolumeGroupSnapshot(csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id=group_id)),
        grpc.StatusCode.NOT_FOUND,
        "does not exist",
    )
    await env.stub.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=group_id))
    await env.stub.DeleteVolumeGroupSnapshot(
        csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=group_id, snapshot_ids=["snap-1"])
    )
    g = await env.stub.CreateVolumeGroupSnapshot(
        csi_pb2.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=volumes(env.manager, 1))
    )
    gid = g.group_snapshot.group_snapshot_id
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(
        env.stub.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=gid)), bad
    )
    assert env.manager.store.get_group_snapshot(gid) is not None  # a delete without the member list changed nothing
