"""Controller service conformance, from the CSI spec's error-code tables and idempotency rules.

The servicer runs over real unix-socket gRPC with the real volume manager on loop-file volumes in a temp dir (mkfs
on plain files needs no root). Each RPC: missing fields are INVALID_ARGUMENT naming the field, compatible repeats are
OK, the same name with other parameters is ALREADY_EXISTS, deleting what is gone is OK, a second operation on a busy
volume is ABORTED.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from csi.backends import fileops
from csi.config import TOPOLOGY_KEY, Config
from csi.controller import CONTROLLER_CAPABILITIES, ControllerServicer
from csi.model import PublishRecord, StageRecord
from csi.state import StateStore
from csi.volumes import CapacityRange, VolumeManager, derive_id
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.metrics import Metrics
from nodeplug.paths import Root

pytestmark = pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")

MIB = 1 << 20
NODE = "node-a"
_Mode = csi_pb2.VolumeCapability.AccessMode


@dataclass
class Env:
    stub: csi_pb2_grpc.ControllerStub
    manager: VolumeManager
    root: Path


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    sockdir = Path(tempfile.mkdtemp(prefix="npcsi-"))
    cfg = Config(node_id=NODE, max_volumes_per_node=20)
    store = StateStore(Root(tmp_path)(cfg.data_dir) / "state.db")
    manager = VolumeManager(store, cfg, root=Root(tmp_path))
    server = aio.server()
    csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(manager), server)
    server.add_insecure_port(f"unix://{sockdir}/csi.sock")
    await server.start()
    try:
        async with aio.insecure_channel(f"unix://{sockdir}/csi.sock") as ch:
            yield Env(csi_pb2_grpc.ControllerStub(ch), manager, tmp_path)
    finally:
        await server.stop(0)
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def cap(mode: int = _Mode.SINGLE_NODE_WRITER, block: bool = False, fs: str = "") -> Any:
    c = csi_pb2.VolumeCapability(access_mode=_Mode(mode=mode))
    if block:
        c.block.SetInParent()
    else:
        c.mount.fs_type = fs
    return c


def create_req(name: str = "pvc-1", size: int = 16 * MIB, **kw: Any) -> Any:
    kw.setdefault("volume_capabilities", [cap()])
    return csi_pb2.CreateVolumeRequest(name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size), **kw)


async def expect(code: grpc.StatusCode, call: Any, *needles: str) -> str:
    with pytest.raises(aio.AioRpcError) as e:
        await call
    assert e.value.code() == code, e.value.details()
    details = e.value.details() or ""
    for n in needles:
        assert n in details, details
    return details


def gone(p: str | Path) -> bool:
    return not os.path.lexists(p)


# ---------------------------------------------------------------- capabilities and unsupported RPCs


async def test_capabilities_are_the_issues_list(env: Env) -> None:
    resp = await env.stub.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest())
    assert {c.rpc.type for c in resp.capabilities} == set(CONTROLLER_CAPABILITIES)
    names = {csi_pb2.ControllerServiceCapability.RPC.Type.Name(c.rpc.type) for c in resp.capabilities}
    assert "PUBLISH_UNPUBLISH_VOLUME" not in names and "MODIFY_VOLUME" not in names


async def test_controller_publish_and_modify_are_unimplemented(env: Env) -> None:
    u = grpc.StatusCode.UNIMPLEMENTED
    await expect(u, env.stub.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(volume_id="vol-1")))
    await expect(u, env.stub.ControllerUnpublishVolume(csi_pb2.ControllerUnpublishVolumeRequest(volume_id="vol-1")))
    await expect(u, env.stub.ControllerModifyVolume(csi_pb2.ControllerModifyVolumeRequest(volume_id="vol-1")))


# ---------------------------------------------------------------- CreateVolume


async def test_create_volume_missing_fields(env: Env) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(bad, env.stub.CreateVolume(create_req(name="")), "name")
    await expect(bad, env.stub.CreateVolume(create_req(volume_capabilities=[])), "volume_capabilities")
    no_type = csi_pb2.VolumeCapability(access_mode=_Mode(mode=_Mode.SINGLE_NODE_WRITER))
    await expect(bad, env.stub.CreateVolume(create_req(volume_capabilities=[no_type])), "access_type")
    await expect(bad, env.stub.CreateVolume(create_req(volume_capabilities=[cap(_Mode.UNKNOWN)])), "access_mode")


@pytest.mark.parametrize("mode", ["MULTI_NODE_READER_ONLY", "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER"])
async def test_create_volume_refuses_multi_node_modes(env: Env, mode: str) -> None:
    req = create_req(volume_capabilities=[cap(_Mode.Mode.Value(mode))])
    await expect(grpc.StatusCode.INVALID_ARGUMENT, env.stub.CreateVolume(req), mode)


@pytest.mark.parametrize(
    "mode", ["SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY", "SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER"]
)
async def test_create_volume_accepts_single_node_modes(env: Env, mode: str) -> None:
    resp = await env.stub.CreateVolume(create_req(volume_capabilities=[cap(_Mode.Mode.Value(mode))]))
    assert resp.volume.volume_id.startswith("vol-")


async def test_create_volume_is_idempotent_and_reports_topology(env: Env) -> None:
    a = await env.stub.CreateVolume(create_req())
    b = await env.stub.CreateVolume(create_req())
    assert a.volume.volume_id == b.volume.volume_id
    assert a.volume.capacity_bytes == 16 * MIB
    assert [dict(t.segments) for t in a.volume.accessible_topology] == [{TOPOLOGY_KEY: NODE}]
    path = Path(env.manager.get_volume(a.volume.volume_id).path)
    st = os.stat(path)
    assert st.st_size == 16 * MIB and st.st_blocks * 512 < 16 * MIB  # sparse
    assert len(env.manager.list_volumes()[0]) == 1


async def test_create_volume_same_name_other_parameters_already_exists(env: Env) -> None:
    await env.stub.CreateVolume(create_req())
    exists = grpc.StatusCode.ALREADY_EXISTS
    await expect(exists, env.stub.CreateVolume(create_req(size=32 * MIB)), "capacity")
    await expect(exists, env.stub.CreateVolume(create_req(volume_capabilities=[cap(block=True)])), "access type")
    xfs = create_req(size=400 * MIB, volume_capabilities=[cap(fs="xfs")])
    await expect(exists, env.stub.CreateVolume(xfs))


async def test_create_volume_topology(env: Env) -> None:
    ours = csi_pb2.Topology(segments={TOPOLOGY_KEY: NODE})
    other = csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-b"})
    req = create_req(accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[other], preferred=[other]))
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, env.stub.CreateVolume(req), "node-a")
    req = create_req(accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[other, ours], preferred=[ours]))
    resp = await env.stub.CreateVolume(req)
    assert dict(resp.volume.accessible_topology[0].segments) == {TOPOLOGY_KEY: NODE}
    # preferred alone does not bind (the spec lets the plugin pick any topology it serves)
    req = create_req("pref", accessibility_requirements=csi_pb2.TopologyRequirement(preferred=[other]))
    resp = await env.stub.CreateVolume(req)
    assert dict(resp.volume.accessible_topology[0].segments) == {TOPOLOGY_KEY: NODE}
    zone = csi_pb2.Topology(segments={TOPOLOGY_KEY: NODE, "topology.kubernetes.io/zone": "z1"})
    req = create_req("zoned", accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[zone]))
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, env.stub.CreateVolume(req))


async def test_create_volume_capacity_errors(env: Env) -> None:
    huge = create_req(name="huge", size=1 << 60)
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, env.stub.CreateVolume(huge), "bytes free")
    tight = csi_pb2.CreateVolumeRequest(
        name="tight",
        capacity_range=csi_pb2.CapacityRange(required_bytes=MIB, limit_bytes=10 * MIB),
        volume_capabilities=[cap(fs="xfs")],
    )
    await expect(grpc.StatusCode.OUT_OF_RANGE, env.stub.CreateVolume(tight), "at least")
    inverted = csi_pb2.CreateVolumeRequest(
        name="inv",
        capacity_range=csi_pb2.CapacityRange(required_bytes=9 * MIB, limit_bytes=MIB),
        volume_capabilities=[cap()],
    )
    await expect(grpc.StatusCode.INVALID_ARGUMENT, env.stub.CreateVolume(inverted), "capacity_range")
    assert env.manager.list_volumes()[0] == []


async def test_create_volume_default_size_and_limit(env: Env) -> None:
    req = csi_pb2.CreateVolumeRequest(
        name="d", capacity_range=csi_pb2.CapacityRange(limit_bytes=8 * MIB), volume_capabilities=[cap()]
    )
    assert (await env.stub.CreateVolume(req)).volume.capacity_bytes == 8 * MIB


async def test_create_volume_parameters(env: Env) -> None:
    bad = create_req(parameters={"colour": "blue"})
    await expect(grpc.StatusCode.INVALID_ARGUMENT, env.stub.CreateVolume(bad), "parameters.colour")
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT, env.stub.CreateVolume(create_req(parameters={"backend": "lvm"})), "backend"
    )
    await expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        env.stub.CreateVolume(create_req(parameters={"backend": "btrfs"})),
        "not enabled",
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        env.stub.CreateVolume(create_req(volume_capabilities=[cap(fs="vfat")])),
        "fs_type",
    )
    meta = {"csi.storage.k8s.io/pvc/name": "data", "backend": "loopfile"}
    assert (await env.stub.CreateVolume(create_req(parameters=meta))).volume.volume_id


async def test_create_block_volume_is_raw(env: Env) -> None:
    resp = await env.stub.CreateVolume(create_req(volume_capabilities=[cap(block=True)]))
    v = env.manager.get_volume(resp.volume.volume_id)
    assert v.access_type == "block" and v.fs_type == ""
    with open(v.path, "rb") as f:  # noqa: ASYNC230
        assert f.read(4096) == bytes(4096)


async def test_create_volume_missing_content_source_is_not_found(env: Env) -> None:
    src = csi_pb2.VolumeContentSource(snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id="snap-none"))
    await expect(grpc.StatusCode.NOT_FOUND, env.stub.CreateVolume(create_req(volume_content_source=src)), "snap-none")
    src = csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id="vol-none"))
    await expect(grpc.StatusCode.NOT_FOUND, env.stub.CreateVolume(create_req(volume_content_source=src)), "vol-none")


async def test_create_volume_from_snapshot_and_clone(env: Env) -> None:
    v = (await env.stub.CreateVolume(create_req("src"))).volume
    s = (await env.stub.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name="s", source_volume_id=v.volume_id))).snapshot
    src = csi_pb2.VolumeContentSource(snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=s.snapshot_id))
    r = (await env.stub.CreateVolume(create_req("restored", size=32 * MIB, volume_content_source=src))).volume
    assert r.content_source.snapshot.snapshot_id == s.snapshot_id and r.capacity_bytes == 32 * MIB
    clone_src = csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=v.volume_id))
    c = (await env.stub.CreateVolume(create_req("clone", volume_content_source=clone_src))).volume
    assert c.content_source.volume.volume_id == v.volume_id
    # a block volume cannot be made from a filesystem snapshot
    bad = create_req("wrong", volume_content_source=src, volume_capabilities=[cap(block=True)])
    await expect(grpc.StatusCode.INVALID_ARGUMENT, env.stub.CreateVolume(bad), "volume_content_source")
    # the same name with another source is a different volume
    await expect(grpc.StatusCode.ALREADY_EXISTS, env.stub.CreateVolume(create_req("restored", size=32 * MIB)))


async def test_create_volume_respects_max_volumes(env: Env) -> None:
    for i in range(20):
        await env.stub.CreateVolume(create_req(f"v{i}", size=MIB))
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, env.stub.CreateVolume(create_req("v20")), "max_volumes_per_node")
    cap_resp = await env.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    assert cap_resp.available_capacity == 0


async def test_create_volume_in_flight_on_same_name_is_aborted(env: Env) -> None:
    with env.manager.locks.hold("name/pvc-1"):
        await expect(grpc.StatusCode.ABORTED, env.stub.CreateVolume(create_req()), "in flight")
    await env.stub.CreateVolume(create_req())


# ---------------------------------------------------------------- DeleteVolume


async def test_delete_volume(env: Env) -> None:
    await expect(grpc.StatusCode.INVALID_ARGUMENT, env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest()), "volume_id")
    v = (await env.stub.CreateVolume(create_req())).volume
    path = Path(env.manager.get_volume(v.volume_id).path)
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))
    assert gone(path)
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))  # gone: OK
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id="vol-never-existed"))
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id="../../etc/passwd"))  # never ours: gone


async def test_delete_volume_in_use_is_failed_precondition(env: Env) -> None:
    v = (await env.stub.CreateVolume(create_req())).volume
    store = env.manager.store
    store.put_stage(StageRecord(v.volume_id, "/var/lib/kubelet/staging", "/dev/loop9"))
    req = csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id)
    await expect(grpc.StatusCode.FAILED_PRECONDITION, env.stub.DeleteVolume(req), "staged")
    store.delete_stage(v.volume_id)
    store.put_publish(PublishRecord(v.volume_id, "/var/lib/kubelet/pods/x", False, ""))
    await expect(grpc.StatusCode.FAILED_PRECONDITION, env.stub.DeleteVolume(req), "published")
    store.delete_publish(v.volume_id, "/var/lib/kubelet/pods/x")
    await env.stub.DeleteVolume(req)


async def test_delete_volume_busy_is_aborted(env: Env) -> None:
    v = (await env.stub.CreateVolume(create_req())).volume
    with env.manager.locks.hold(f"volume/{v.volume_id}"):
        await expect(grpc.StatusCode.ABORTED, env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id)))
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))


# ---------------------------------------------------------------- ValidateVolumeCapabilities


async def test_validate_volume_capabilities(env: Env) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    V = csi_pb2.ValidateVolumeCapabilitiesRequest
    await expect(bad, env.stub.ValidateVolumeCapabilities(V(volume_capabilities=[cap()])), "volume_id")
    v = (await env.stub.CreateVolume(create_req())).volume
    await expect(bad, env.stub.ValidateVolumeCapabilities(V(volume_id=v.volume_id)), "volume_capabilities")
    await expect(
        grpc.StatusCode.NOT_FOUND,
        env.stub.ValidateVolumeCapabilities(V(volume_id="vol-x", volume_capabilities=[cap()])),
    )
    ok = await env.stub.ValidateVolumeCapabilities(V(volume_id=v.volume_id, volume_capabilities=[cap(fs="ext4")]))
    assert ok.HasField("confirmed") and len(ok.confirmed.volume_capabilities) == 1
    for wrong in (cap(block=True), cap(fs="xfs"), cap(_Mode.MULTI_NODE_MULTI_WRITER)):
        no = await env.stub.ValidateVolumeCapabilities(V(volume_id=v.volume_id, volume_capabilities=[wrong]))
        assert not no.HasField("confirmed") and no.message
    other_backend = V(volume_id=v.volume_id, volume_capabilities=[cap()], parameters={"backend": "btrfs"})
    no = await env.stub.ValidateVolumeCapabilities(other_backend)
    assert not no.HasField("confirmed") and "loopfile" in no.message


# ---------------------------------------------------------------- ListVolumes and GetCapacity


async def test_list_volumes_paginates(env: Env) -> None:
    ids = [(await env.stub.CreateVolume(create_req(f"v{i}", size=MIB))).volume.volume_id for i in range(5)]
    seen, token = [], ""
    while True:
        resp = await env.stub.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=2, starting_token=token))
        assert len(resp.entries) <= 2
        seen += [e.volume.volume_id for e in resp.entries]
        assert all(not e.status.volume_condition.abnormal for e in resp.entries)
        token = resp.next_token
        if not token:
            break
    assert seen == ids
    all_at_once = await env.stub.ListVolumes(csi_pb2.ListVolumesRequest())
    assert [e.volume.volume_id for e in all_at_once.entries] == ids and all_at_once.next_token == ""


async def test_list_volumes_bad_arguments(env: Env) -> None:
    await expect(
        grpc.StatusCode.ABORTED, env.stub.ListVolumes(csi_pb2.ListVolumesRequest(starting_token="invalid-token"))
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        env.stub.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=-1)),
        "max_entries",
    )


async def test_get_capacity_is_real_free_space_and_honours_topology(env: Env) -> None:
    st = os.statvfs(env.root)
    resp = await env.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    # the disk is shared with other work, so allow for what it freed meanwhile
    assert 0 < resp.available_capacity <= st.f_bavail * st.f_frsize + (1 << 30)
    ours = csi_pb2.Topology(segments={TOPOLOGY_KEY: NODE})
    other = csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-b"})
    assert (await env.stub.GetCapacity(csi_pb2.GetCapacityRequest(accessible_topology=ours))).available_capacity > 0
    assert (await env.stub.GetCapacity(csi_pb2.GetCapacityRequest(accessible_topology=other))).available_capacity == 0
    btrfs = csi_pb2.GetCapacityRequest(parameters={"backend": "btrfs"})
    assert (await env.stub.GetCapacity(btrfs)).available_capacity == 0  # not enabled here
    multi = csi_pb2.GetCapacityRequest(volume_capabilities=[cap(_Mode.MULTI_NODE_MULTI_WRITER)])
    assert (await env.stub.GetCapacity(multi)).available_capacity == 0


async def test_capacity_accounts_for_promised_space(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = 10 << 30  # the filesystem's free space, held still (other tests share the real disk)
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: disk)
    before = (await env.stub.GetCapacity(csi_pb2.GetCapacityRequest())).available_capacity
    assert before == disk
    v = (await env.stub.CreateVolume(create_req("big", size=512 * MIB, volume_capabilities=[cap(block=True)]))).volume
    allocated = fileops.allocated_bytes(Path(env.manager.get_volume(v.volume_id).path))
    after = (await env.stub.GetCapacity(csi_pb2.GetCapacityRequest())).available_capacity
    assert after == disk - (512 * MIB - allocated)  # the sparse file may still grow into its capacity
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, env.stub.CreateVolume(create_req("more", size=after + MIB)))


# ---------------------------------------------------------------- ControllerExpandVolume and ControllerGetVolume


async def test_expand_volume(env: Env) -> None:
    E = csi_pb2.ControllerExpandVolumeRequest
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(bad, env.stub.ControllerExpandVolume(E(capacity_range=csi_pb2.CapacityRange(required_bytes=1))))
    v = (await env.stub.CreateVolume(create_req())).volume
    await expect(bad, env.stub.ControllerExpandVolume(E(volume_id=v.volume_id)), "capacity_range")
    grow = csi_pb2.CapacityRange(required_bytes=40 * MIB)
    await expect(grpc.StatusCode.NOT_FOUND, env.stub.ControllerExpandVolume(E(volume_id="vol-x", capacity_range=grow)))
    r = await env.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=grow))
    assert r.capacity_bytes == 40 * MIB and r.node_expansion_required
    assert os.stat(env.manager.get_volume(v.volume_id).path).st_size == 40 * MIB
    again = await env.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=grow))
    assert again.capacity_bytes == 40 * MIB
    smaller = csi_pb2.CapacityRange(required_bytes=8 * MIB)
    assert (await env.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=smaller))).capacity_bytes == (
        40 * MIB
    )
    huge = csi_pb2.CapacityRange(required_bytes=1 << 60)
    await expect(
        grpc.StatusCode.OUT_OF_RANGE, env.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=huge))
    )
    wrong = E(volume_id=v.volume_id, capacity_range=grow, volume_capability=cap(block=True))
    await expect(bad, env.stub.ControllerExpandVolume(wrong), "volume_capability")
    with env.manager.locks.hold(f"volume/{v.volume_id}"):
        await expect(
            grpc.StatusCode.ABORTED, env.stub.ControllerExpandVolume(E(volume_id=v.volume_id, capacity_range=grow))
        )


async def test_get_volume_reports_condition(env: Env) -> None:
    G = csi_pb2.ControllerGetVolumeRequest
    await expect(grpc.StatusCode.INVALID_ARGUMENT, env.stub.ControllerGetVolume(G()), "volume_id")
    await expect(grpc.StatusCode.NOT_FOUND, env.stub.ControllerGetVolume(G(volume_id="vol-x")))
    v = (await env.stub.CreateVolume(create_req())).volume
    ok = await env.stub.ControllerGetVolume(G(volume_id=v.volume_id))
    assert ok.volume.volume_id == v.volume_id and not ok.status.volume_condition.abnormal
    os.unlink(env.manager.get_volume(v.volume_id).path)
    lost = await env.stub.ControllerGetVolume(G(volume_id=v.volume_id))
    assert lost.status.volume_condition.abnormal and "missing" in lost.status.volume_condition.message
    listed = await env.stub.ListVolumes(csi_pb2.ListVolumesRequest())
    assert listed.entries[0].status.volume_condition.abnormal


# ---------------------------------------------------------------- snapshots


async def test_create_snapshot(env: Env) -> None:
    S = csi_pb2.CreateSnapshotRequest
    bad = grpc.StatusCode.INVALID_ARGUMENT
    v = (await env.stub.CreateVolume(create_req())).volume
    await expect(bad, env.stub.CreateSnapshot(S(source_volume_id=v.volume_id)), "name")
    await expect(bad, env.stub.CreateSnapshot(S(name="s")), "source_volume_id")
    await expect(grpc.StatusCode.NOT_FOUND, env.stub.CreateSnapshot(S(name="s", source_volume_id="vol-x")))
    a = (await env.stub.CreateSnapshot(S(name="s", source_volume_id=v.volume_id))).snapshot
    b = (await env.stub.CreateSnapshot(S(name="s", source_volume_id=v.volume_id))).snapshot
    assert a.snapshot_id == b.snapshot_id and a.ready_to_use and a.size_bytes == 16 * MIB
    assert a.source_volume_id == v.volume_id and a.creation_time.seconds > 0
    other = (await env.stub.CreateVolume(create_req("other"))).volume
    await expect(grpc.StatusCode.ALREADY_EXISTS, env.stub.CreateSnapshot(S(name="s", source_volume_id=other.volume_id)))
    with env.manager.locks.hold(f"volume/{other.volume_id}"):
        await expect(grpc.StatusCode.ABORTED, env.stub.CreateSnapshot(S(name="s2", source_volume_id=other.volume_id)))
    # the snapshot outlives its source volume
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))
    got = await env.stub.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=a.snapshot_id))
    assert got.snapshot.snapshot_id == a.snapshot_id


async def test_delete_get_list_snapshots(env: Env) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(bad, env.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest()), "snapshot_id")
    await expect(bad, env.stub.GetSnapshot(csi_pb2.GetSnapshotRequest()), "snapshot_id")
    await expect(grpc.StatusCode.NOT_FOUND, env.stub.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id="snap-x")))
    v1 = (await env.stub.CreateVolume(create_req("a", size=MIB))).volume
    v2 = (await env.stub.CreateVolume(create_req("b", size=MIB))).volume
    ids = []
    for i, v in enumerate([v1, v2, v1]):
        s = await env.stub.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name=f"s{i}", source_volume_id=v.volume_id))
        ids.append(s.snapshot.snapshot_id)
    L = csi_pb2.ListSnapshotsRequest
    assert [e.snapshot.snapshot_id for e in (await env.stub.ListSnapshots(L())).entries] == ids
    by_src = await env.stub.ListSnapshots(L(source_volume_id=v1.volume_id))
    assert [e.snapshot.snapshot_id for e in by_src.entries] == [ids[0], ids[2]]
    assert [e.snapshot.snapshot_id for e in (await env.stub.ListSnapshots(L(snapshot_id=ids[1]))).entries] == [ids[1]]
    assert not (await env.stub.ListSnapshots(L(snapshot_id="snap-missing"))).entries
    assert not (await env.stub.ListSnapshots(L(source_volume_id="vol-missing"))).entries
    page = await env.stub.ListSnapshots(L(max_entries=2))
    assert len(page.entries) == 2 and page.next_token
    rest = await env.stub.ListSnapshots(L(max_entries=2, starting_token=page.next_token))
    assert [e.snapshot.snapshot_id for e in rest.entries] == [ids[2]] and not rest.next_token
    await expect(grpc.StatusCode.ABORTED, env.stub.ListSnapshots(L(starting_token="nope")))
    path = Path(env.manager.snapshots.get_snapshot(ids[0]).path)
    await env.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=ids[0]))
    assert gone(path)
    await env.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=ids[0]))
    await env.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id="snap/../../x"))


async def test_state_survives_a_restart(env: Env, tmp_path: Path) -> None:
    v = (await env.stub.CreateVolume(create_req())).volume
    cfg = env.manager.config
    store2 = StateStore(Root(tmp_path)(cfg.data_dir) / "state.db")
    m2 = VolumeManager(store2, cfg, root=Root(tmp_path))
    try:
        assert m2.get_volume(v.volume_id).capacity_bytes == 16 * MIB
        again = m2.create_volume("pvc-1", capacity_range=CapacityRange(16 * MIB), access_type="mount")
        assert again.volume_id == v.volume_id
    finally:
        store2.close()


async def test_create_after_a_crash_clears_the_unrecorded_leftover(env: Env) -> None:
    """A crash between building the file and recording it leaves a file under the name-derived id; a retry of the
    same CreateVolume replaces it instead of failing or leaking it."""
    vid = derive_id("vol", "pvc-crash")
    volumes = env.root / "var/lib/nodeplug/csi/volumes"
    volumes.mkdir(parents=True)
    (volumes / f"{vid}.img").write_bytes(b"half")
    (volumes / f".tmp-{vid}.img").write_bytes(b"half")
    v = (await env.stub.CreateVolume(create_req("pvc-crash"))).volume
    assert v.volume_id == vid
    assert (volumes / f"{vid}.img").stat().st_size == 16 * MIB
    assert not (volumes / f".tmp-{vid}.img").exists()


async def test_concurrent_creates_of_one_name_make_one_volume(env: Env) -> None:
    results = await asyncio.gather(
        *(env.stub.CreateVolume(create_req("race")) for _ in range(8)), return_exceptions=True
    )
    ok = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    assert ok and all(r.volume.volume_id == ok[0].volume.volume_id for r in ok)
    assert all(isinstance(e, aio.AioRpcError) and e.code() == grpc.StatusCode.ABORTED for e in failed)
    assert [v.name for v in env.manager.list_volumes()[0]] == ["race"]


async def test_concurrent_creates_and_deletes_of_many_volumes(env: Env) -> None:
    names = [f"many-{i}" for i in range(16)]
    created = await asyncio.gather(*(env.stub.CreateVolume(create_req(n, size=MIB)) for n in names))
    assert len({c.volume.volume_id for c in created}) == 16
    await asyncio.gather(
        *(env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=c.volume.volume_id)) for c in created)
    )
    assert env.manager.list_volumes()[0] == [] and env.manager.unrecorded() == []


async def test_unrecorded_files_are_reported_not_deleted(env: Env) -> None:
    await env.stub.CreateVolume(create_req())
    stray = env.root / "var/lib/nodeplug/csi/volumes/vol-stray.img"
    stray.write_bytes(b"x")
    assert env.manager.unrecorded() == [stray]
    assert stray.read_bytes() == b"x"


async def test_get_capacity_reports_volume_size_bounds(env: Env) -> None:
    resp = await env.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    assert resp.maximum_volume_size.value == resp.available_capacity
    assert resp.minimum_volume_size.value == MIB


async def test_list_volumes_pagination_as_the_sanity_suite_checks_it(env: Env) -> None:
    """Delete the last volume of a page and add one: the token still yields total - page entries."""
    ids = [(await env.stub.CreateVolume(create_req(f"p{i}", size=MIB))).volume.volume_id for i in range(3)]
    first = await env.stub.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=2))
    assert first.next_token == "2" and [e.volume.volume_id for e in first.entries] == ids[:2]
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=ids[1]))
    await env.stub.CreateVolume(create_req("p-new", size=MIB))
    rest = await env.stub.ListVolumes(csi_pb2.ListVolumesRequest(starting_token=first.next_token))
    assert len(rest.entries) == 3 - 2
    past = csi_pb2.ListSnapshotsRequest(starting_token="5")
    await expect(grpc.StatusCode.ABORTED, env.stub.ListSnapshots(past), "past the end")
    await expect(grpc.StatusCode.INVALID_ARGUMENT, env.stub.ListSnapshots(csi_pb2.ListSnapshotsRequest(max_entries=-1)))


async def test_operations_on_a_volume_whose_file_is_gone(env: Env) -> None:
    v = (await env.stub.CreateVolume(create_req("lost"))).volume
    os.unlink(env.manager.get_volume(v.volume_id).path)
    fp = grpc.StatusCode.FAILED_PRECONDITION
    snap = csi_pb2.CreateSnapshotRequest(name="s-lost", source_volume_id=v.volume_id)
    await expect(fp, env.stub.CreateSnapshot(snap), "is missing")
    grow = csi_pb2.ControllerExpandVolumeRequest(
        volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MIB)
    )
    await expect(fp, env.stub.ControllerExpandVolume(grow), "is missing")
    src = csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=v.volume_id))
    await expect(fp, env.stub.CreateVolume(create_req("clone-lost", volume_content_source=src)), "is missing")
    assert env.manager.get_volume(v.volume_id).capacity_bytes == 16 * MIB  # nothing half-changed
    assert env.manager.snapshots.list_snapshots()[0] == [] and env.manager.unrecorded() == []
    await env.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))


async def test_status_codes_reach_the_agents_rpc_metrics(tmp_path: Path) -> None:
    """Served the way the plugin serves it (UnixGrpcServer and its interceptor), a domain error is counted with
    its status code."""
    cfg = Config(node_id=NODE)
    store = StateStore(tmp_path / "state.db")
    manager = VolumeManager(store, cfg, root=Root(tmp_path))
    metrics = Metrics()
    sockdir = Path(tempfile.mkdtemp(prefix="npcsi-"))
    server = UnixGrpcServer(sockdir / "csi.sock", "csi", metrics)
    server.add(csi_pb2_grpc.add_ControllerServicer_to_server, ControllerServicer(manager))
    await server.start()
    try:
        async with aio.insecure_channel(f"unix://{sockdir}/csi.sock") as ch:
            stub = csi_pb2_grpc.ControllerStub(ch)
            await stub.CreateVolume(create_req())
            await expect(grpc.StatusCode.ALREADY_EXISTS, stub.CreateVolume(create_req(size=32 * MIB)))
            await expect(
                grpc.StatusCode.NOT_FOUND,
                stub.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id="vol-x")),
            )
    finally:
        await server.stop(0)
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)
    text = metrics.render().decode()
    create = "/csi.v1.Controller/CreateVolume"
    assert f'nodeplug_rpc_total{{code="OK",method="{create}",plugin="csi"}} 1.0' in text
    assert f'nodeplug_rpc_total{{code="ALREADY_EXISTS",method="{create}",plugin="csi"}} 1.0' in text
    assert 'code="NOT_FOUND",method="/csi.v1.Controller/ControllerGetVolume"' in text


async def test_a_volume_being_recorded_is_never_counted_twice(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A create holds its bytes until its volume is recorded, then the record counts: never both at once. The record
    is written and the hold released under the space lock, so a space check by another create, which takes that
    lock, sees one or the other: what the first create left, never less."""
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 64 * MIB)
    store = env.manager.store
    write = store.put_volume
    seen: list[tuple[bool, int]] = []

    def write_under_the_lock(volume: Any) -> None:
        space = env.manager._space
        seen.append((space.locked(), env.manager._reserved.get("loopfile", 0)))  # held, and the bytes still held
        write(volume)

    monkeypatch.setattr(store, "put_volume", write_under_the_lock)
    await env.stub.CreateVolume(create_req("first", size=32 * MIB, volume_capabilities=[cap(block=True)]))
    assert seen == [(True, 32 * MIB)]
    assert env.manager._reserved.get("loopfile", 0) == 0  # released with the record, under the same lock
    assert env.manager.get_capacity({}) == 32 * MIB  # 64 MiB free, 32 MiB promised to the first volume (sparse)


async def test_concurrent_creates_never_promise_more_than_the_disk(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 100 * MIB)  # a small disk, held still
    reqs = [create_req(f"c{i}", size=32 * MIB, volume_capabilities=[cap(block=True)]) for i in range(8)]
    results = await asyncio.gather(*(env.stub.CreateVolume(r) for r in reqs), return_exceptions=True)
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, aio.AioRpcError)]
    assert len(ok) == 3 and len(refused) == 5  # 3 x 32 MiB fit in 100 MiB, a fourth would not
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    assert (
        await env.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    ).available_capacity <= 4 * MIB + 100 * MIB - 96 * MIB


async def test_snapshots_do_not_take_space_promised_to_volumes(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    v = (await env.stub.CreateVolume(create_req("full", size=16 * MIB, volume_capabilities=[cap(block=True)]))).volume
    with open(env.manager.get_volume(v.volume_id).path, "r+b") as f:  # noqa: ASYNC230
        f.write(os.urandom(8 * MIB))
        os.fsync(f.fileno())
    # the disk holds exactly what the volume may still grow into: a sparse copy of its 8 MiB must not fit
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 8 * MIB + MIB)
    snap = csi_pb2.CreateSnapshotRequest(name="no-room", source_volume_id=v.volume_id)
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, env.stub.CreateSnapshot(snap), "bytes free")
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 8 * MIB + 9 * MIB)
    assert (await env.stub.CreateSnapshot(snap)).snapshot.ready_to_use
