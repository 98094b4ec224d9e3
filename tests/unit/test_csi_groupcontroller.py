"""GroupController conformance: create/get/delete group snapshots per the spec's tables (loop-file volumes)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc import aio

from csi.config import Config
from csi.controller import ControllerServicer
from csi.groupcontroller import GroupControllerServicer
from csi.model import StageRecord
from csi.state import StateStore
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.paths import Root

pytestmark = pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
MIB = 1 << 20


@dataclass
class Env:
    stub: csi_pb2_grpc.GroupControllerStub
    snaps: csi_pb2_grpc.ControllerStub
    manager: VolumeManager


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    sockdir = Path(tempfile.mkdtemp(prefix="npcsi-"))
    cfg = Config(node_id="n1")
    store = StateStore(Root(tmp_path)(cfg.data_dir) / "state.db")
    manager = VolumeManager(store, cfg, root=Root(tmp_path))
    server = aio.server()
    csi_pb2_grpc.add_GroupControllerServicer_to_server(GroupControllerServicer(manager), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(manager), server)
    server.add_insecure_port(f"unix://{sockdir}/csi.sock")
    await server.start()
    try:
        async with aio.insecure_channel(f"unix://{sockdir}/csi.sock") as ch:
            yield Env(csi_pb2_grpc.GroupControllerStub(ch), csi_pb2_grpc.ControllerStub(ch), manager)
    finally:
        await server.stop(0)
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def volumes(m: VolumeManager, n: int, access: str = "mount") -> list[str]:
    return [
        m.create_volume(f"gv{i}-{access}", capacity_range=CapacityRange(4 * MIB), access_type=access).volume_id
        for i in range(n)
    ]


async def expect(code: grpc.StatusCode, call: object, needle: str = "") -> None:
    with pytest.raises(aio.AioRpcError) as e:
        await call  # type: ignore[misc]
    assert e.value.code() == code, e.value.details()
    assert needle in (e.value.details() or "")


def gone(p: str) -> bool:
    return not os.path.lexists(p)


async def test_capabilities(env: Env) -> None:
    resp = await env.stub.GroupControllerGetCapabilities(csi_pb2.GroupControllerGetCapabilitiesRequest())
    assert [c.rpc.type for c in resp.capabilities] == [
        csi_pb2.GroupControllerServiceCapability.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT
    ]


async def test_group_snapshot_lifecycle(env: Env) -> None:
    ids = volumes(env.manager, 3)
    C = csi_pb2.CreateVolumeGroupSnapshotRequest
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(bad, env.stub.CreateVolumeGroupSnapshot(C(source_volume_ids=ids)), "name")
    await expect(bad, env.stub.CreateVolumeGroupSnapshot(C(name="g")), "source_volume_ids")
    await expect(
        grpc.StatusCode.NOT_FOUND, env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=["vol-x"]))
    )
    g = (await env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids))).group_snapshot
    assert g.ready_to_use and len(g.snapshots) == 3
    assert {s.source_volume_id for s in g.snapshots} == set(ids)
    assert all(s.group_snapshot_id == g.group_snapshot_id for s in g.snapshots)
    again = (await env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids[::-1]))).group_snapshot
    assert again.group_snapshot_id == g.group_snapshot_id
    await expect(
        grpc.StatusCode.ALREADY_EXISTS, env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids[:2]))
    )
    member_ids = [s.snapshot_id for s in g.snapshots]

    G = csi_pb2.GetVolumeGroupSnapshotRequest
    got = await env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids))
    assert {s.snapshot_id for s in got.group_snapshot.snapshots} == set(member_ids)
    await expect(bad, env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id)), "snapshot_ids")
    await expect(
        bad,
        env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids[:1])),
        "snapshot_ids",
    )
    # a member snapshot is usable alone, but only deleted with its group
    listed = await env.snaps.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=member_ids[0]))
    assert listed.entries[0].snapshot.group_snapshot_id == g.group_snapshot_id
    await expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        env.snaps.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=member_ids[0])),
        "group",
    )

    D = csi_pb2.DeleteVolumeGroupSnapshotRequest
    await expect(bad, env.stub.DeleteVolumeGroupSnapshot(D(snapshot_ids=member_ids)), "group_snapshot_id")
    await expect(
        bad,
        env.stub.DeleteVolumeGroupSnapshot(D(group_snapshot_id=g.group_snapshot_id, snapshot_ids=["snap-1"])),
        "snapshot_ids",
    )
    paths = [env.manager.snapshots.get_snapshot(i).path for i in member_ids]
    await env.stub.DeleteVolumeGroupSnapshot(D(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids))
    assert all(gone(p) for p in paths)
    await env.stub.DeleteVolumeGroupSnapshot(D(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids))
    await expect(
        grpc.StatusCode.NOT_FOUND,
        env.stub.GetVolumeGroupSnapshot(G(group_snapshot_id=g.group_snapshot_id, snapshot_ids=member_ids)),
    )
    assert not (await env.snaps.ListSnapshots(csi_pb2.ListSnapshotsRequest())).entries


async def test_group_of_staged_block_volumes_cannot_be_consistent(env: Env) -> None:
    ids = volumes(env.manager, 2, "block")
    env.manager.store.put_stage(StageRecord(ids[0], "/var/lib/kubelet/staging/x", "/dev/loop9"))
    C = csi_pb2.CreateVolumeGroupSnapshotRequest
    await expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        env.stub.CreateVolumeGroupSnapshot(C(name="g", source_volume_ids=ids)),
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
            grpc.StatusCode.ABORTED,
            env.stub.CreateVolumeGroupSnapshot(
                csi_pb2.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=ids)
            ),
        )
    assert not (await env.snaps.ListSnapshots(csi_pb2.ListSnapshotsRequest())).entries


@pytest.mark.parametrize("group_id", ["group-00000000000000000000000000000000", "invalid-id", "../x"])
async def test_an_unknown_group_is_answered_by_its_id_first(env: Env, group_id: str) -> None:
    """As the reference driver and csi-sanity have it: a group that does not exist is NOT_FOUND for Get and already
    deleted for Delete, whether or not snapshot_ids were sent; the member list is checked against a group that is."""
    await expect(
        grpc.StatusCode.NOT_FOUND,
        env.stub.GetVolumeGroupSnapshot(csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id=group_id)),
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
        bad, env.stub.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=gid))
    )
    assert env.manager.store.get_group_snapshot(gid) is not None  # a delete without the member list changed nothing
