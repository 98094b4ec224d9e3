"""Controller service: snapshots, restarts and crashes, concurrency, space accounting and RPC metrics (loop-file
volumes in a temp dir, the fixture ``ctl``, tests/support/csicontroller.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from csi.backends import fileops
from csi.config import Config
from csi.controller import ControllerServicer
from csi.state import StateStore
from csi.volumes import CapacityRange, VolumeManager, derive_id
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.metrics import Metrics
from nodeplug.paths import Root

from support.csicontroller import MIB, NODE, ControllerEnv, create_req, gone, needs_mkfs_ext4
from support.csidriver import cap, expect

pytestmark = needs_mkfs_ext4


# ---------------------------------------------------------------- snapshots


async def test_create_snapshot(ctl: ControllerEnv) -> None:
    S = csi_pb2.CreateSnapshotRequest
    bad = grpc.StatusCode.INVALID_ARGUMENT
    v = (await ctl.stub.CreateVolume(create_req())).volume
    await expect(ctl.stub.CreateSnapshot(S(source_volume_id=v.volume_id)), bad, "name")
    await expect(ctl.stub.CreateSnapshot(S(name="s")), bad, "source_volume_id")
    await expect(ctl.stub.CreateSnapshot(S(name="s", source_volume_id="vol-x")), grpc.StatusCode.NOT_FOUND)
    a = (await ctl.stub.CreateSnapshot(S(name="s", source_volume_id=v.volume_id))).snapshot
    b = (await ctl.stub.CreateSnapshot(S(name="s", source_volume_id=v.volume_id))).snapshot
    assert a.snapshot_id == b.snapshot_id and a.ready_to_use and a.size_bytes == 16 * MIB
    assert a.source_volume_id == v.volume_id and a.creation_time.seconds > 0
    other = (await ctl.stub.CreateVolume(create_req("other"))).volume
    await expect(ctl.stub.CreateSnapshot(S(name="s", source_volume_id=other.volume_id)), grpc.StatusCode.ALREADY_EXISTS)
    with ctl.manager.locks.hold(f"volume/{other.volume_id}"):
        await expect(ctl.stub.CreateSnapshot(S(name="s2", source_volume_id=other.volume_id)), grpc.StatusCode.ABORTED)
    # the snapshot outlives its source volume
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))
    got = await ctl.stub.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=a.snapshot_id))
    assert got.snapshot.snapshot_id == a.snapshot_id


async def test_delete_get_list_snapshots(ctl: ControllerEnv) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(ctl.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest()), bad, "snapshot_id")
    await expect(ctl.stub.GetSnapshot(csi_pb2.GetSnapshotRequest()), bad, "snapshot_id")
    await expect(ctl.stub.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id="snap-x")), grpc.StatusCode.NOT_FOUND)
    v1 = (await ctl.stub.CreateVolume(create_req("a", size=MIB))).volume
    v2 = (await ctl.stub.CreateVolume(create_req("b", size=MIB))).volume
    ids = []
    for i, v in enumerate([v1, v2, v1]):
        s = await ctl.stub.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name=f"s{i}", source_volume_id=v.volume_id))
        ids.append(s.snapshot.snapshot_id)
    L = csi_pb2.ListSnapshotsRequest
    assert [e.snapshot.snapshot_id for e in (await ctl.stub.ListSnapshots(L())).entries] == ids
    by_src = await ctl.stub.ListSnapshots(L(source_volume_id=v1.volume_id))
    assert [e.snapshot.snapshot_id for e in by_src.entries] == [ids[0], ids[2]]
    assert [e.snapshot.snapshot_id for e in (await ctl.stub.ListSnapshots(L(snapshot_id=ids[1]))).entries] == [ids[1]]
    assert not (await ctl.stub.ListSnapshots(L(snapshot_id="snap-missing"))).entries
    assert not (await ctl.stub.ListSnapshots(L(source_volume_id="vol-missing"))).entries
    page = await ctl.stub.ListSnapshots(L(max_entries=2))
    assert len(page.entries) == 2 and page.next_token
    rest = await ctl.stub.ListSnapshots(L(max_entries=2, starting_token=page.next_token))
    assert [e.snapshot.snapshot_id for e in rest.entries] == [ids[2]] and not rest.next_token
    await expect(ctl.stub.ListSnapshots(L(starting_token="nope")), grpc.StatusCode.ABORTED)
    path = Path(ctl.manager.snapshots.get_snapshot(ids[0]).path)
    await ctl.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=ids[0]))
    assert gone(path)
    await ctl.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=ids[0]))
    await ctl.stub.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id="snap/../../x"))


async def test_state_survives_a_restart(ctl: ControllerEnv, tmp_path: Path) -> None:
    v = (await ctl.stub.CreateVolume(create_req())).volume
    cfg = ctl.manager.config
    store2 = StateStore(Root(tmp_path)(cfg.data_dir) / "state.db")
    m2 = VolumeManager(store2, cfg, root=Root(tmp_path))
    try:
        assert m2.get_volume(v.volume_id).capacity_bytes == 16 * MIB
        again = m2.create_volume("pvc-1", capacity_range=CapacityRange(16 * MIB), access_type="mount")
        assert again.volume_id == v.volume_id
    finally:
        store2.close()


async def test_create_after_a_crash_clears_the_unrecorded_leftover(ctl: ControllerEnv) -> None:
    """A crash between building the file and recording it leaves a file under the name-derived id; a retry of the
    same CreateVolume replaces it instead of failing or leaking it."""
    vid = derive_id("vol", "pvc-crash")
    volumes = ctl.root / "var/lib/nodeplug/csi/volumes"
    volumes.mkdir(parents=True)
    (volumes / f"{vid}.img").write_bytes(b"half")
    (volumes / f".tmp-{vid}.img").write_bytes(b"half")
    v = (await ctl.stub.CreateVolume(create_req("pvc-crash"))).volume
    assert v.volume_id == vid
    assert (volumes / f"{vid}.img").stat().st_size == 16 * MIB
    assert not (volumes / f".tmp-{vid}.img").exists()


async def test_concurrent_creates_of_one_name_make_one_volume(ctl: ControllerEnv) -> None:
    results = await asyncio.gather(
        *(ctl.stub.CreateVolume(create_req("race")) for _ in range(8)), return_exceptions=True
    )
    ok = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    assert ok and all(r.volume.volume_id == ok[0].volume.volume_id for r in ok)
    assert all(isinstance(e, aio.AioRpcError) and e.code() == grpc.StatusCode.ABORTED for e in failed)
    assert [v.name for v in ctl.manager.list_volumes()[0]] == ["race"]


async def test_concurrent_creates_and_deletes_of_many_volumes(ctl: ControllerEnv) -> None:
    names = [f"many-{i}" for i in range(16)]
    created = await asyncio.gather(*(ctl.stub.CreateVolume(create_req(n, size=MIB)) for n in names))
    assert len({c.volume.volume_id for c in created}) == 16
    await asyncio.gather(
        *(ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=c.volume.volume_id)) for c in created)
    )
    assert ctl.manager.list_volumes()[0] == [] and ctl.manager.unrecorded() == []


async def test_unrecorded_files_are_reported_not_deleted(ctl: ControllerEnv) -> None:
    await ctl.stub.CreateVolume(create_req())
    stray = ctl.root / "var/lib/nodeplug/csi/volumes/vol-stray.img"
    stray.write_bytes(b"x")
    assert ctl.manager.unrecorded() == [stray]
    assert stray.read_bytes() == b"x"


async def test_get_capacity_reports_volume_size_bounds(ctl: ControllerEnv) -> None:
    resp = await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    assert resp.maximum_volume_size.value == resp.available_capacity
    assert resp.minimum_volume_size.value == MIB


async def test_list_volumes_pagination_as_the_sanity_suite_checks_it(ctl: ControllerEnv) -> None:
    """Delete the last volume of a page and add one: the token still yields total - page entries."""
    ids = [(await ctl.stub.CreateVolume(create_req(f"p{i}", size=MIB))).volume.volume_id for i in range(3)]
    first = await ctl.stub.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=2))
    assert first.next_token == "2" and [e.volume.volume_id for e in first.entries] == ids[:2]
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=ids[1]))
    await ctl.stub.CreateVolume(create_req("p-new", size=MIB))
    rest = await ctl.stub.ListVolumes(csi_pb2.ListVolumesRequest(starting_token=first.next_token))
    assert len(rest.entries) == 3 - 2
    past = csi_pb2.ListSnapshotsRequest(starting_token="5")
    await expect(ctl.stub.ListSnapshots(past), grpc.StatusCode.ABORTED, "past the end")
    await expect(ctl.stub.ListSnapshots(csi_pb2.ListSnapshotsRequest(max_entries=-1)), grpc.StatusCode.INVALID_ARGUMENT)


async def test_operations_on_a_volume_whose_file_is_gone(ctl: ControllerEnv) -> None:
    v = (await ctl.stub.CreateVolume(create_req("lost"))).volume
    os.unlink(ctl.manager.get_volume(v.volume_id).path)
    fp = grpc.StatusCode.FAILED_PRECONDITION
    snap = csi_pb2.CreateSnapshotRequest(name="s-lost", source_volume_id=v.volume_id)
    await expect(ctl.stub.CreateSnapshot(snap), fp, "is missing")
    grow = csi_pb2.ControllerExpandVolumeRequest(
        volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MIB)
    )
    await expect(ctl.stub.ControllerExpandVolume(grow), fp, "is missing")
    src = csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=v.volume_id))
    await expect(ctl.stub.CreateVolume(create_req("clone-lost", volume_content_source=src)), fp, "is missing")
    assert ctl.manager.get_volume(v.volume_id).capacity_bytes == 16 * MIB  # nothing half-changed
    assert ctl.manager.snapshots.list_snapshots()[0] == [] and ctl.manager.unrecorded() == []
    await ctl.stub.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))


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
            await expect(stub.CreateVolume(create_req(size=32 * MIB)), grpc.StatusCode.ALREADY_EXISTS)
            await expect(
                stub.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id="vol-x")),
                grpc.StatusCode.NOT_FOUND,
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


async def test_a_volume_being_recorded_is_never_counted_twice(
    ctl: ControllerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create holds its bytes until its volume is recorded, then the record counts: never both at once. The record
    is written and the hold released under the space lock, so a space check by another create, which takes that
    lock, sees one or the other: what the first create left, never less."""
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 64 * MIB)
    store = ctl.manager.store
    write = store.put_volume
    seen: list[tuple[bool, int]] = []

    def write_under_the_lock(volume: Any) -> None:
        seen.append((ctl.manager.space.locked(), ctl.manager.reserved("loopfile")))  # locked, the bytes still held
        write(volume)

    monkeypatch.setattr(store, "put_volume", write_under_the_lock)
    await ctl.stub.CreateVolume(create_req("first", size=32 * MIB, volume_capabilities=[cap(block=True)]))
    assert seen == [(True, 32 * MIB)]
    assert ctl.manager.reserved("loopfile") == 0  # released with the record, under the same lock
    assert ctl.manager.get_capacity({}) == 32 * MIB  # 64 MiB free, 32 MiB promised to the first volume (sparse)


async def test_concurrent_creates_never_promise_more_than_the_disk(
    ctl: ControllerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 100 * MIB)  # a small disk, held still
    reqs = [create_req(f"c{i}", size=32 * MIB, volume_capabilities=[cap(block=True)]) for i in range(8)]
    results = await asyncio.gather(*(ctl.stub.CreateVolume(r) for r in reqs), return_exceptions=True)
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, aio.AioRpcError)]
    assert len(ok) == 3 and len(refused) == 5  # 3 x 32 MiB fit in 100 MiB, a fourth would not
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    assert (
        await ctl.stub.GetCapacity(csi_pb2.GetCapacityRequest())
    ).available_capacity <= 4 * MIB + 100 * MIB - 96 * MIB


async def test_snapshots_do_not_take_space_promised_to_volumes(
    ctl: ControllerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    v = (await ctl.stub.CreateVolume(create_req("full", size=16 * MIB, volume_capabilities=[cap(block=True)]))).volume
    with open(ctl.manager.get_volume(v.volume_id).path, "r+b") as f:  # noqa: ASYNC230
        f.write(os.urandom(8 * MIB))
        os.fsync(f.fileno())
    # the disk holds exactly what the volume may still grow into: a sparse copy of its 8 MiB must not fit
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 8 * MIB + MIB)
    snap = csi_pb2.CreateSnapshotRequest(name="no-room", source_volume_id=v.volume_id)
    await expect(ctl.stub.CreateSnapshot(snap), grpc.StatusCode.RESOURCE_EXHAUSTED, "bytes free")
    monkeypatch.setattr(fileops, "free_bytes", lambda _path: 8 * MIB + 9 * MIB)
    assert (await ctl.stub.CreateSnapshot(snap)).snapshot.ready_to_use
