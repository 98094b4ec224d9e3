"""Controller service conformance, from the CSI spec's error-code tables and idempotency rules: volumes.

The servicer runs over real unix-socket gRPC with the real volume manager on loop-file volumes in a temp dir (the
fixture ``ctl``, tests/support/csicontroller.py). Each RPC: missing fields are INVALID_ARGUMENT naming
the field, compatible repeats are OK, the same name with other parameters is ALREADY_EXISTS, deleting what is gone
is OK, a second operation on a busy volume is ABORTED.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from csi.backends import fileops
from csi.config import TOPOLOGY_KEY
from csi.controller import CONTROLLER_CAPABILITIES
from csi.model import PublishRecord, StageRecord
from nodeplug.api.csi.v1 import csi_pb2

from support.csicontroller import MIB, NODE, AccessMode, ControllerEnv, create_req, gone, needs_mkfs_ext4
from support.csidriver import cap, expect

pytestmark = needs_mkfs_ext4


# ---------------------------------------------------------------- capabilities and unsupported RPCs


async def test_capabilities_are_the_issues_list(ctl: ControllerEnv) -> None:
    resp = await ctl.stub.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest())
    assert {c.rpc.type for c in resp.capabilities} == set(CONTROLLER_CAPABILITIES)
    names = {csi_pb2.ControllerServiceCapability.RPC.Type.Name(c.rpc.type) for c in resp.capabilities}
    assert "PUBLISH_UNPUBLISH_VOLUME" not in names and "MODIFY_VOLUME" not in names


async def test_controller_publish_and_modify_are_unimplemented(ctl: ControllerEnv) -> None:
    u = grpc.StatusCode.UNIMPLEMENTED
    await expect(ctl.stub.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(volume_id="vol-1")), u)
    await expect(ctl.stub.ControllerUnpublishVolume(csi_pb2.ControllerUnpublishVolumeRequest(volume_id="vol-1")), u)
    await expect(ctl.stub.ControllerModifyVolume(csi_pb2.ControllerModifyVolumeRequest(volume_id="vol-1")), u)


# ---------------------------------------------------------------- CreateVolume


async def test_create_volume_missing_fields(ctl: ControllerEnv) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(ctl.stub.CreateVolume(create_req(name="")), bad, "name")
    await expect(ctl.stub.CreateVolume(create_req(volume_capabilities=[])), bad, "volume_capabilities")
    no_type = csi_pb2.VolumeCapability(access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))
    await expect(ctl.stub.CreateVolume(create_req(volume_capabilities=[no_type])), bad, "access_type")
    await expect(
        ctl.stub.CreateVolume(create_req(volume_capabilities=[cap(mode=AccessMode.UNKNOWN)])), bad, "access_mode"
    )


@pytest.mark.parametrize("mode", ["MULTI_NODE_READER_ONLY", "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER"])
async def test_create_volume_refuses_multi_node_modes(ctl: ControllerEnv, mode: str) -> None:
    req = create_req(volume_capabilities=[cap(mode=AccessMode.Mode.Value(mode))])
    await expect(ctl.stub.CreateVolume(req), grpc.StatusCode.INVALID_ARGUMENT, mode)


@pytest.mark.parametrize(
    "mode", ["SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY", "SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER"]
)
async def test_create_volume_accepts_single_node_modes(ctl: ControllerEnv, mode: str) -> None:
    resp = await ctl.stub.CreateVolume(create_req(volume_capabilities=[cap(mode=AccessMode.Mode.Value(mode))]))
    assert resp.volume.volume_id.startswith("vol-")


async def test_create_volume_is_idempotent_and_reports_topology(ctl: ControllerEnv) -> None:
    a = await ctl.stub.CreateVolume(create_req())
    b = await ctl.stub.CreateVolume(create_req())
    assert a.volume.volume_id == b.volume.volume_id
    assert a.volume.capacity_bytes == 16 * MIB
    assert [dict(t.segments) for t in a.volume.accessible_topology] == [{TOPOLOGY_KEY: NODE}]
    path = Path(ctl.manager.get_volume(a.volume.volume_id).path)
    st = os.stat(path)
    assert st.st_size == 16 * MIB and st.st_blocks * 512 < 16 * MIB  # sparse
    assert len(ctl.manager.list_volumes()[0]) == 1


async def test_create_volume_same_name_other_parameters_already_exists(ctl: ControllerEnv) -> None:
    await ctl.stub.CreateVolume(create_req())
    exists = grpc.StatusCode.ALREADY_EXISTS
    await expect(ctl.stub.CreateVolume(create_req(size=32 * MIB)), exists, "capacity")
    await expect(ctl.stub.CreateVolume(create_req(volume_capabilities=[cap(block=True)])), exists, "access type")
    xfs = create_req(size=400 * MIB, volume_capabilities=[cap(fs="xfs")])
    await expect(ctl.stub.CreateVolume(xfs), exists)


async def test_create_volume_topology(ctl: ControllerEnv) -> None:
    ours = csi_pb2.Topology(segments={TOPOLOGY_KEY: NODE})
    other = csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-b"})
    req = create_req(accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[other], preferred=[other]))
    await expect(ctl.stub.CreateVolume(req), grpc.StatusCode.RESOURCE_EXHAUSTED, "node-a")
    req = create_req(accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[other, ours], preferred=[ours]))
    resp = await ctl.stub.CreateVolume(req)
    assert dict(resp.volume.accessible_topology[0].segments) == {TOPOLOGY_KEY: NODE}
    # preferred alone does not bind (the spec lets the plugin pick any topology it serves)
    req = create_req("pref", accessibility_requirements=csi_pb2.TopologyRequirement(preferred=[other]))
    resp = await ctl.stub.CreateVolume(req)
    assert dict(resp.volume.accessible_topology[0].segments) == {TOPOLOGY_KEY: NODE}
    zone = csi_pb2.Topology(segments={TOPOLOGY_KEY: NODE, "topology.kubernetes.io/zone": "z1"})
    req = create_req("zoned", accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[zone]))
    await expect(ctl.stub.CreateVolume(req), grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_create_volume_capacity_errors(ctl: ControllerEnv) -> None:
    huge = create_req(name="huge", size=1 << 60)
    await expect(ctl.stub.CreateVolume(huge), grpc.StatusCode.RESOURCE_EXHAUSTED, "bytes free")
    tight = csi_pb2.CreateVolumeRequest(
        name="tight",
        capacity_range=csi_pb2.CapacityRange(required_bytes=MIB, limit_bytes=10 * MIB),
        volume_capabilities=[cap(fs="xfs")],
    )
    await expect(ctl.stub.CreateVolume(tight), grpc.StatusCode.OUT_OF_RANGE, "at least")
    inverted = csi_pb2.CreateVolumeRequest(
        name="inv",
        capacity_range=csi_pb2.CapacityRange(required_bytes=9 * MIB, limit_bytes=MIB),
        volume_capabilities=[cap()],
    )
    await expect(ctl.stub.CreateVolume(inverted), grpc.StatusCode.INVALID_ARGUMENT, "capacity_range")
    assert ctl.manager.list_volumes()[0] == []


async def test_create_volume_default_size_and_limit(ctl: ControllerEnv) -> None:
    req = csi_pb2.CreateVolumeRequest(
        name="d", capacity_range=csi_pb2.CapacityRange(limit_bytes=8 * MIB), volume_capabilities=[cap()]
    )
    assert (await ctl.stub.CreateVolume(req)).volume.capacity_bytes == 8 * MIB


async def test_create_volume_parameters(ctl: ControllerEnv) -> None:
    bad = create_req(parameters={"colour": "blue"})
    await expect(ctl.stub.CreateVolume(bad), grpc.StatusCode.INVALID_ARGUMENT, "parameters.colour")
    await expect(
        ctl.stub.CreateVolume(create_req(parameters={"backend": "lvm"})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "backend",
    )
    await expect(
        ctl.stub.CreateVolume(create_req(parameters={"backend": "btrfs"})),
        grpc.StatusCode.FAILED_PRECONDITION,
        "not enabled",
    )
    await expect(
        ctl.stub.CreateVolume(create_req(volume_capabilities=[cap(fs="vfat")])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "fs_type",
    )
    meta = {"csi.storage.k8s.io/pvc/name": "data", "backend": "loopfile"}
    assert (await ctl.stub.CreateVolume(create_req(parameters=meta))).volume.volume_id


async def test_create_block_volume_is_raw(ctl: ControllerEnv) -> None:
    resp = await ctl.stub.CreateVolume(create_req(volume_capabilities=[cap(block=True)]))
    v = ctl.manager.get_volume(resp.volume.volume_id)
    assert v.access_type == "block" and v.fs_type == ""
    with open(v.path, "rb") as f:  # noqa: ASYNC230
        assert f.read(4096) == bytes(4096)


async def test_create_volume_missing_content_source_is_not_found(ctl: ControllerEnv) -> None:
    src = csi_pb2.VolumeContentSource(snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id="snap-none"))
    await expect(ctl.stub.CreateVolume(create_req(volume_content_source=src)), grpc.StatusCode.NOT_FOUND, "snap-none")
    src = csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id="vol-none"))
    await expect(ctl.stub.CreateVolume(create_req(volume_content_source=src)), grpc.StatusCode.NOT_FOUND, "vol-none")


async def test_create_volume_from_snapshot_and_clone(ctl: ControllerEnv) -> None:
    v = (await ctl.stub.CreateVolume(create_req("src"))).volume
    s = (await ctl.stub.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name="s", source_volume_id=v.volume_id))).snapshot
    src = csi_pb2.VolumeContentSource(snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=s.snapshot_id))
    r = (await ctl.stub.CreateVolume(create_req("restored", size=32 * MIB, volume_content_source=src))).volume
    assert r.content_source.snapshot.snapshot_id == s.snapshot_id and r.capacity_bytes == 32 * MIB
    clone_src = csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=v.volume_id))
    c = (await ctl.stub.CreateVolume(create_req("clone", volume_content_source=clone_src))).volume
    assert c.content_source.volume.volume_id == v.volume_id
    # a block volume cannot be made from a filesystem snapshot
    bad = create_req("wrong", volume_content_source=src, volume_capabilities=[cap(block=True)])
    await expect(ctl.stub.CreateVolume(bad), grpc.StatusCode.INVALID_ARGUMENT, "volume_content_source")
    # the same name with another source is a different volume
    await expect(ctl.stub.CreateVolume(create_req("restored", size=32 * MIB)), grpc.StatusCode.ALREADY_EXISTS)


async def test_create_volume_respects_max_volumes(ctl: ControllerEnv) -> None:
    for i in range(20):
        await ctl.stub.CreateVolume(create_req(f"v{i}", size=MIB))
    await expect(ctl.stub.CreateVolume(create_req("v20")), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_volumes_per_node")
    cap_resp = await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    assert cap_resp.available_capacity == 0


async def test_create_volume_in_flight_on_same_name_is_aborted(ctl: ControllerEnv) -> None:
    with ctl.manager.locks.hold("name/pvc-1"):
        await expect(ctl.stub.CreateVolume(create_req()), grpc.StatusCode.ABORTED, "in flight")
    await ctl.stub.CreateVolume(create_req())


# ---------------------------------------------------------------- DeleteVolume


async def test_delete_volume(ctl: ControllerEnv) -> None:
    await expect(ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest()), grpc.StatusCode.INVALID_ARGUMENT, "volume_id")
    v = (await ctl.stub.CreateVolume(create_req())).volume
    path = Path(ctl.manager.get_volume(v.volume_id).path)
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))
    assert gone(path)
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))  # gone: OK
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id="vol-never-existed"))
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id="../../etc/passwd"))  # never ours: gone


async def test_delete_volume_in_use_is_failed_precondition(ctl: ControllerEnv) -> None:
    v = (await ctl.stub.CreateVolume(create_req())).volume
    store = ctl.manager.store
    store.put_stage(StageRecord(v.volume_id, "/var/lib/kubelet/staging", "/dev/loop9"))
    req = csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id)
    await expect(ctl.stub.DeleteVolume(req), grpc.StatusCode.FAILED_PRECONDITION, "staged")
    store.delete_stage(v.volume_id)
    store.put_publish(PublishRecord(v.volume_id, "/var/lib/kubelet/pods/x", False, ""))
    await expect(ctl.stub.DeleteVolume(req), grpc.StatusCode.FAILED_PRECONDITION, "published")
    store.delete_publish(v.volume_id, "/var/lib/kubelet/pods/x")
    await ctl.stub.DeleteVolume(req)


async def test_delete_volume_busy_is_aborted(ctl: ControllerEnv) -> None:
    v = (await ctl.stub.CreateVolume(create_req())).volume
    with ctl.manager.locks.hold(f"volume/{v.volume_id}"):
        await expect(ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id)), grpc.StatusCode.ABORTED)
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))


# ---------------------------------------------------------------- ValidateVolumeCapabilities


async def test_validate_volume_capabilities(ctl: ControllerEnv) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    V = csi_pb2.ValidateVolumeCapabilitiesRequest
    await expect(ctl.stub.ValidateVolumeCapabilities(V(volume_capabilities=[cap()])), bad, "volume_id")
    v = (await ctl.stub.CreateVolume(create_req())).volume
    await expect(ctl.stub.ValidateVolumeCapabilities(V(volume_id=v.volume_id)), bad, "volume_capabilities")
    await expect(
        ctl.stub.ValidateVolumeCapabilities(V(volume_id="vol-x", volume_capabilities=[cap()])),
        grpc.StatusCode.NOT_FOUND,
    )
    ok = await ctl.stub.ValidateVolumeCapabilities(V(volume_id=v.volume_id, volume_capabilities=[cap(fs="ext4")]))
    assert ok.HasField("confirmed") and len(ok.confirmed.volume_capabilities) == 1
    for wrong in (cap(block=True), cap(fs="xfs"), cap(mode=AccessMode.MULTI_NODE_MULTI_WRITER)):
        no = await ctl.stub.ValidateVolumeCapabilities(V(volume_id=v.volume_id, volume_capabilities=[wrong]))
        assert not no.HasField("confirmed") and no.message
    other_backend = V(volume_id=v.volume_id, volume_capabilities=[cap()], parameters={"backend": "btrfs"})
    no = await ctl.stub.ValidateVolumeCapabilities(other_backend)
    assert not no.HasField("confirmed") and "loopfile" in no.message


# ---------------------------------------------------------------- ListVolumes and GetCapacity


async def test_list_volumes_paginates(ctl: ControllerEnv) -> None:
    ids = [(await ctl.stub.CreateVolume(create_req(f"v{i}", size=MIB))).volume.volume_id for i in range(5)]
    seen, token = [], ""
    while True:
        resp = await ctl.stub.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=2, starting_token=token))
        assert len(resp.entries) <= 2
        seen += [e.volume.volume_id for e in resp.entries]
        assert all(not e.status.volume_condition.abnormal for e in resp.entries)
        token = resp.next_token
        if not token:
            break
    assert seen == ids
    all_at_once = await ctl.stub.ListVolumes(csi_pb2.ListVolumesRequest())
    assert [e.volume.volume_id for e in all_at_once.entries] == ids and all_at_once.next_token == ""


async def test_list_volumes_bad_arguments(ctl: ControllerEnv) -> None:
    await expect(
        ctl.stub.ListVolumes(csi_pb2.ListVolumesRequest(starting_token="invalid-token")), grpc.StatusCode.ABORTED
    )
    await expect(
        ctl.stub.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_entries",
    )


async def test_get_capacity_is_real_free_space_and_honours_topology(ctl: ControllerEnv) -> None:
    st = os.statvfs(ctl.root)
    resp = await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    # the disk is shared with other work, so allow for what it freed meanwhile
    assert 0 < resp.available_capacity <= st.f_bavail * st.f_frsize + (1 << 30)
    ours = csi_pb2.Topology(segments={TOPOLOGY_KEY: NODE})
    other = csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-b"})
    assert (await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest(accessible_topology=ours))).available_capacity > 0
    assert (await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest(accessible_topology=other))).available_capacity == 0
    btrfs = csi_pb2.GetCapacityRequest(parameters={"backend": "btrfs"})
    assert (await ctl.stub.GetCapacity(btrfs)).available_capacity == 0  # not enabled here
    multi = csi_pb2.GetCapacityRequest(volume_capabilities=[cap(mode=AccessMode.MULTI_NODE_MULTI_WRITER)])
    assert (await ctl.stub.GetCapacity(multi)).available_capacity == 0


async def test_capacity_accounts_for_promised_space(ctl: ControllerEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = 10 << 30  # the filesystem's free space, held still (other tests share the real disk)
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: disk)
    before = (await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest())).available_capacity
    assert before == disk
    v = (await ctl.stub.CreateVolume(create_req("big", size=512 * MIB, volume_capabilities=[cap(block=True)]))).volume
    allocated = fileops.allocated_bytes(Path(ctl.manager.get_volume(v.volume_id).path))
    after = (await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest())).available_capacity
    assert after == disk - (512 * MIB - allocated)  # the sparse file may still grow into its capacity
    await expect(ctl.stub.CreateVolume(create_req("more", size=after + MIB)), grpc.StatusCode.RESOURCE_EXHAUSTED)


# ---------------------------------------------------------------- ControllerExpandVolume and ControllerGetVolume


async def test_expand_volume(ctl: ControllerEnv) -> None:
    E = csi_pb2.ControllerExpandVolumeRequest
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(ctl.stub.ControllerExpandVolume(E(capacity_range=csi_pb2.CapacityRange(required_bytes=1))), bad)
    v = (await ctl.stub.CreateVolume(create_req())).volume
    await expect(ctl.stub.ControllerExpandVolume(E(volume_id=v.volume_id)), bad, "capacity_range")
    grow = csi_pb2.CapacityRange(required_bytes=40 * MIB)
    await expect(ctl.stub.ControllerExpandVolume(E(volume_id="vol-x", capacity_range=grow)), grpc.StatusCode.NOT_FOUND)
    r = await ctl.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=grow))
    assert r.capacity_bytes == 40 * MIB and r.node_expansion_required
    assert os.stat(ctl.manager.get_volume(v.volume_id).path).st_size == 40 * MIB
    again = await ctl.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=grow))
    assert again.capacity_bytes == 40 * MIB
    smaller = csi_pb2.CapacityRange(required_bytes=8 * MIB)
    assert (await ctl.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=smaller))).capacity_bytes == (
        40 * MIB
    )
    huge = csi_pb2.CapacityRange(required_bytes=1 << 60)
    await expect(
        ctl.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=huge)),
        grpc.StatusCode.OUT_OF_RANGE,
    )
    wrong = E(volume_id=v.volume_id, capacity_range=grow, volume_capability=cap(block=True))
    await expect(ctl.stub.ControllerExpandVolume(wrong), bad, "volume_capability")
    with ctl.manager.locks.hold(f"volume/{v.volume_id}"):
        await expect(
            ctl.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=grow)),
            grpc.StatusCode.ABORTED,
        )


async def test_get_volume_reports_condition(ctl: ControllerEnv) -> None:
    G = csi_pb2.ControllerGetVolumeRequest
    await expect(ctl.stub.ControllerGetVolume(G()), grpc.StatusCode.INVALID_ARGUMENT, "volume_id")
    await expect(ctl.stub.ControllerGetVolume(G(volume_id="vol-x")), grpc.StatusCode.NOT_FOUND)
    v = (await ctl.stub.CreateVolume(create_req())).volume
    ok = await ctl.stub.ControllerGetVolume(G(volume_id=v.volume_id))
    assert ok.volume.volume_id == v.volume_id and not ok.status.volume_condition.abnormal
    os.unlink(ctl.manager.get_volume(v.volume_id).path)
    lost = await ctl.stub.ControllerGetVolume(G(volume_id=v.volume_id))
    assert lost.status.volume_condition.abnormal and "missing" in lost.status.volume_condition.message
    listed = await ctl.stub.ListVolumes(csi_pb2.ListVolumesRequest())
    assert listed.entries[0].status.volume_condition.abnormal
