"""The loop-file backend on the real kernel: mkfs'd files, loop devices, mounts, frozen snapshots, size limits."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from csi import loopdev
from csi.backends import fileops
from csi.config import Config
from csi.errors import Internal
from csi.model import StageRecord, Volume, VolumeSource
from csi.state import StateStore
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.paths import Root

from support.host import sh

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")
MIB = 1 << 20


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[VolumeManager]:
    cfg = Config(node_id="n1")
    store = StateStore(Root(tmp_path)(cfg.data_dir) / "state.db")
    yield VolumeManager(store, cfg, root=Root(tmp_path))
    store.close()


@contextlib.contextmanager
def mounted(v: Volume, where: Path, mounts: Callable[[Path], Path], ro: bool = False) -> Iterator[Path]:
    """Mount a volume's file through a loop device (as the node side would), and take it all down afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    dev = loopdev.attach_rw(Path(v.path))
    try:
        sh("mount", "-t", v.fs_type, "-o", "ro" if ro else "rw", dev, str(mounts(where)))
        try:
            yield where
        finally:
            sh("umount", str(where))
    finally:
        loopdev.detach(dev)


def fs_bytes(p: Path) -> int:
    st = os.statvfs(p)
    return st.f_blocks * st.f_frsize


@pytest.mark.parametrize("fs,size", [("ext4", 16 * MIB), ("xfs", 300 * MIB)])
def test_snapshot_restore_and_clone_keep_data(
    manager: VolumeManager, tmp_path: Path, mounts: Callable[[Path], Path], fs: str, size: int
) -> None:
    payload = os.urandom(MIB)
    src = manager.create_volume("src", capacity_range=CapacityRange(size), access_type="mount", fs_type=fs)
    with mounted(src, tmp_path / "m-src", mounts) as m:
        (m / "data.bin").write_bytes(payload)
        original = fs_bytes(m)
    snap = manager.snapshots.create_snapshot("snap", src.volume_id, {})
    assert snap.size_bytes == size and snap.fs_type == fs
    with mounted(src, tmp_path / "m-src", mounts) as m:  # the source changes after the snapshot
        (m / "data.bin").write_bytes(b"changed")

    restored = manager.create_volume(
        "restored",
        capacity_range=CapacityRange(size + 64 * MIB),
        access_type="mount",
        fs_type=fs,
        source=VolumeSource("snapshot", snap.snapshot_id),
    )
    assert os.stat(restored.path).st_size == size + 64 * MIB
    with mounted(restored, tmp_path / "m-restored", mounts) as m:
        assert (m / "data.bin").read_bytes() == payload
        assert fs_bytes(m) > original + 48 * MIB  # the filesystem grew with the file

    clone = manager.create_volume(
        "clone",
        capacity_range=CapacityRange(size),
        access_type="mount",
        fs_type=fs,
        source=VolumeSource("volume", src.volume_id),
    )
    with mounted(clone, tmp_path / "m-clone", mounts) as m:
        assert (m / "data.bin").read_bytes() == b"changed"

    for v in (src, restored, clone):
        manager.delete_volume(v.volume_id)
        assert not os.path.exists(v.path)
    manager.snapshots.delete_snapshot(snap.snapshot_id)
    assert not os.path.exists(snap.path)


def test_snapshot_of_a_staged_volume_freezes_it(
    manager: VolumeManager, tmp_path: Path, mounts: Callable[[Path], Path]
) -> None:
    """Data still in the page cache of the mounted filesystem reaches the snapshot: fsfreeze flushed it."""
    v = manager.create_volume("live", capacity_range=CapacityRange(32 * MIB), access_type="mount", fs_type="ext4")
    staging = tmp_path / "kubelet" / "staging"
    with mounted(v, staging, mounts) as m:
        manager.store.put_stage(StageRecord(v.volume_id, str(staging), loopdev.rw_device(Path(v.path)) or ""))
        payload = os.urandom(3 * MIB)
        (m / "unsynced.bin").write_bytes(payload)  # no fsync: still dirty in the page cache
        snap = manager.snapshots.create_snapshot("live-snap", v.volume_id, {})
        (m / "after.txt").write_text("thawed")  # the filesystem is writable again
        manager.store.delete_stage(v.volume_id)
    r = manager.create_volume(
        "from-live",
        capacity_range=CapacityRange(32 * MIB),
        access_type="mount",
        fs_type="ext4",
        source=VolumeSource("snapshot", snap.snapshot_id),
    )
    with mounted(r, tmp_path / "m-r", mounts) as m:
        assert (m / "unsynced.bin").read_bytes() == payload
        assert not (m / "after.txt").exists()


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_copies_of_a_staged_volume_mount_beside_it(
    manager: VolumeManager, tmp_path: Path, mounts: Callable[[Path], Path], fs: str
) -> None:
    """A snapshot of a mounted filesystem has a dirty log and, for xfs, its source's UUID: the restore and the clone
    are made ready so they mount (plainly, as the node does) while the source is still mounted."""
    v = manager.create_volume(f"live-{fs}", capacity_range=CapacityRange(300 * MIB), access_type="mount", fs_type=fs)
    staging = tmp_path / "kubelet" / "staging"
    with mounted(v, staging, mounts) as m:
        manager.store.put_stage(StageRecord(v.volume_id, str(staging), loopdev.rw_device(Path(v.path)) or ""))
        (m / "f").write_text("before")
        snap = manager.snapshots.create_snapshot(f"s-{fs}", v.volume_id, {})
        restored, clone = (
            manager.create_volume(name, capacity_range=CapacityRange(size), access_type="mount", fs_type=fs, source=src)
            for name, size, src in (
                (f"r-{fs}", 400 * MIB, VolumeSource("snapshot", snap.snapshot_id)),
                (f"c-{fs}", 300 * MIB, VolumeSource("volume", v.volume_id)),
            )
        )
        with mounted(restored, tmp_path / "m-r", mounts) as r, mounted(clone, tmp_path / "m-c", mounts) as c:
            assert (r / "f").read_text() == "before" and (c / "f").read_text() == "before"
            assert fs_bytes(r) > fs_bytes(m) + 64 * MIB
        manager.store.delete_stage(v.volume_id)


def test_mount_volume_capacity_is_enforced(
    manager: VolumeManager, tmp_path: Path, mounts: Callable[[Path], Path]
) -> None:
    v = manager.create_volume("small", capacity_range=CapacityRange(16 * MIB), access_type="mount", fs_type="ext4")
    with mounted(v, tmp_path / "m", mounts) as m:
        with pytest.raises(OSError) as e, open(m / "big", "wb") as f:
            for _ in range(32):
                f.write(bytes(MIB))
            f.flush()
            os.fsync(f.fileno())
        assert e.value.errno == errno.ENOSPC
    assert os.stat(v.path).st_size == 16 * MIB


def test_block_volume_capacity_and_expansion(manager: VolumeManager) -> None:
    v = manager.create_volume("blk", capacity_range=CapacityRange(8 * MIB), access_type="block")
    dev = loopdev.attach_rw(Path(v.path))
    try:
        assert loopdev.attach_rw(Path(v.path)) == dev  # a second attach reuses the device
        assert int(sh("blockdev", "--getsize64", dev)) == 8 * MIB
        fd = os.open(dev, os.O_WRONLY)
        try:
            os.pwrite(fd, b"x" * 4096, 8 * MIB - 4096)  # the last page: fine
            with pytest.raises(OSError) as e:
                os.pwrite(fd, b"x" * 4096, 8 * MIB)  # beyond the capacity
            assert e.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
        size, node = manager.expand_volume(v.volume_id, 24 * MIB)
        assert (size, node) == (24 * MIB, True)
        loopdev.refresh_size(dev)  # what NodeExpandVolume does for a block volume
        assert int(sh("blockdev", "--getsize64", dev)) == 24 * MIB
    finally:
        loopdev.detach(dev)
    loopdev.detach(dev)  # already detached: fine
    assert loopdev.devices_of(Path(v.path)) == []
    manager.delete_volume(v.volume_id)


def test_block_snapshot_copies_raw_bytes(manager: VolumeManager) -> None:
    v = manager.create_volume("raw", capacity_range=CapacityRange(8 * MIB), access_type="block")
    with open(v.path, "r+b") as f:
        f.seek(5 * MIB)
        f.write(b"marker")
    s = manager.snapshots.create_snapshot("raw-snap", v.volume_id, {})
    r = manager.create_volume(
        "raw-r",
        capacity_range=CapacityRange(16 * MIB),
        access_type="block",
        source=VolumeSource("snapshot", s.snapshot_id),
    )
    with open(r.path, "rb") as f:
        f.seek(5 * MIB)
        assert f.read(6) == b"marker"
    assert os.stat(r.path).st_size == 16 * MIB
    assert os.stat(s.path).st_blocks * 512 < 2 * MIB  # a sparse copy


def test_condition_sees_ext4_errors(manager: VolumeManager) -> None:
    v = manager.create_volume("sick", capacity_range=CapacityRange(16 * MIB), access_type="mount", fs_type="ext4")
    assert not manager.volume_condition(v.volume_id).abnormal
    sh("debugfs", "-w", "-R", "ssv error_count 3", v.path)  # what the kernel records on an ext4 error
    cond = manager.volume_condition(v.volume_id)
    assert cond.abnormal and "3 errors" in cond.message
    sh("debugfs", "-w", "-R", "ssv error_count 0", v.path)
    sh("debugfs", "-w", "-R", "ssv state 2", v.path)  # EXT2_ERROR_FS
    cond = manager.volume_condition(v.volume_id)
    assert cond.abnormal and "with errors" in cond.message


def test_never_deletes_outside_the_data_dir(manager: VolumeManager, tmp_path: Path) -> None:
    outside = tmp_path / "precious.img"
    outside.write_bytes(b"keep")
    rogue = Volume("vol-rogue", "rogue", MIB, "loopfile", "block", "", str(outside))
    with pytest.raises(Internal, match="outside the driver's data dir"):
        manager.backends["loopfile"].delete(rogue)
    with pytest.raises(Internal):
        fileops.remove_under(manager.data_dir / "volumes" / ".." / ".." / "precious.img", manager.data_dir)
    assert outside.read_bytes() == b"keep"


def test_snapshot_of_a_staged_block_volume_flushes_the_device(manager: VolumeManager) -> None:
    v = manager.create_volume("live-blk", capacity_range=CapacityRange(8 * MIB), access_type="block")
    dev = loopdev.attach_rw(Path(v.path))
    try:
        manager.store.put_stage(StageRecord(v.volume_id, "/var/lib/kubelet/staging/blk", dev))
        fd = os.open(dev, os.O_WRONLY)  # held open like a pod's (the last close would flush by itself)
        try:
            os.pwrite(fd, b"buffered-marker", 3 * MIB)  # in the device's page cache, not yet in the file
            s = manager.snapshots.create_snapshot("live-blk-snap", v.volume_id, {})
        finally:
            os.close(fd)
        with open(s.path, "rb") as f:
            f.seek(3 * MIB)
            assert f.read(15) == b"buffered-marker"
    finally:
        manager.store.delete_stage(v.volume_id)
        loopdev.detach(dev)


def test_thaw_all_after_a_crash_while_frozen(
    manager: VolumeManager, tmp_path: Path, mounts: Callable[[Path], Path]
) -> None:
    v = manager.create_volume("frozen", capacity_range=CapacityRange(16 * MIB), access_type="mount", fs_type="ext4")
    staging = tmp_path / "kubelet" / "st aging"  # a space: escaped as \040 in mountinfo
    with mounted(v, staging, mounts) as m:
        manager.store.put_stage(StageRecord(v.volume_id, str(staging), ""))
        sh("fsfreeze", "-f", str(m))  # as if the agent died in the middle of a snapshot
        assert manager.snapshots.thaw_all() == [str(staging)]
        (m / "writable").write_text("again")
        assert manager.snapshots.thaw_all() == []  # nothing frozen: nothing to do
        manager.store.delete_stage(v.volume_id)


def test_freeze_and_thaw_touch_only_the_volumes_own_filesystem(
    manager: VolumeManager, tmp_path: Path, mounts: Callable[[Path], Path], loop_device: Callable[[int], str]
) -> None:
    """A stage record pointing at a path where another filesystem is mounted (another volume's, anybody's): a
    snapshot neither freezes it nor does the start-up thaw touch it when it is frozen on purpose."""
    v = manager.create_volume("mine", capacity_range=CapacityRange(16 * MIB), access_type="mount", fs_type="ext4")
    foreign = loop_device(16 * MIB)
    sh("mkfs.ext4", "-q", foreign)
    staging = mounts(tmp_path / "kubelet" / "staging")
    staging.mkdir(parents=True)
    sh("mount", foreign, str(staging))
    manager.store.put_stage(StageRecord(v.volume_id, str(staging), ""))
    sh("fsfreeze", "-f", str(staging))  # frozen by its owner
    try:
        assert manager.snapshots.thaw_all() == []
        s = manager.snapshots.create_snapshot("mine-snap", v.volume_id, {})  # does not freeze (or thaw) it either
        assert s.ready_to_use
    finally:
        sh("fsfreeze", "-u", str(staging), check=False)
        manager.store.delete_stage(v.volume_id)
