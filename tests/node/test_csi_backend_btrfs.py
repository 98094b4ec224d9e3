"""The btrfs backend on a real btrfs (made on a loop device): qgroup-limited subvolumes, CoW snapshots and clones,
limit raised on expansion, reflinked loop files for block and ext4 volumes."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from csi.backends import fileops
from csi.backends.btrfs import BtrfsBackend, subvolume_id
from csi.config import Config
from csi.errors import FailedPrecondition
from csi.model import VolumeSource
from csi.state import StateStore
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.paths import Root

from support.host import sh

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes btrfs on a loop device and mounts it")
MIB = 1 << 20


@pytest.fixture
def btrfs_root(tmp_path: Path, loop_device: Callable[[int], str], mounts: Callable[[Path], Path]) -> Path:
    """``tmp_path`` as the agent root, with a fresh btrfs mounted at ``<root>/btrfs``."""
    dev = loop_device(512 * MIB)
    sh("mkfs.btrfs", "-q", "-f", dev)
    mnt = tmp_path / "btrfs"
    mnt.mkdir()
    sh("mount", "-t", "btrfs", dev, str(mounts(mnt)))
    return tmp_path


@pytest.fixture
def manager(btrfs_root: Path) -> Iterator[VolumeManager]:
    cfg = Config(node_id="n1", btrfs={"enabled": True, "path": "/btrfs"}, default_backend="btrfs")
    store = StateStore(Root(btrfs_root)(cfg.data_dir) / "state.db")
    yield VolumeManager(store, cfg, root=Root(btrfs_root))
    store.close()


def write(path: Path, nbytes: int, chunk: bytes | None = None) -> None:
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, MIB)
            f.write(chunk[:n] if chunk else os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def test_subvolume_size_is_enforced_and_expansion_raises_it(manager: VolumeManager) -> None:
    v = manager.create_volume("pvc", capacity_range=CapacityRange(32 * MIB), access_type="mount")
    assert v.backend == "btrfs" and v.fs_type == "btrfs" and v.is_subvolume
    sid = subvolume_id(Path(v.path))
    assert f"Subvolume ID: {sid}" in " ".join(sh("btrfs", "subvolume", "show", v.path).split())
    assert subvolume_id(Path(v.path).parent) == 0  # a plain directory
    write(Path(v.path) / "fits", 16 * MIB)
    with pytest.raises(OSError) as e:
        write(Path(v.path) / "too-much", 48 * MIB)
    assert e.value.errno == errno.EDQUOT
    os.unlink(Path(v.path) / "too-much")
    sh("btrfs", "filesystem", "sync", v.path)
    size, node = manager.expand_volume(v.volume_id, 96 * MIB)
    assert (size, node) == (96 * MIB, False)  # nothing for the node to do
    write(Path(v.path) / "now-fits", 48 * MIB)
    assert manager.get_volume(v.volume_id).capacity_bytes == 96 * MIB
    manager.delete_volume(v.volume_id)
    assert not os.path.exists(v.path)


def test_subvolume_snapshot_restore_and_clone(manager: VolumeManager) -> None:
    v = manager.create_volume("src", capacity_range=CapacityRange(64 * MIB), access_type="mount", fs_type="btrfs")
    payload = os.urandom(2 * MIB)
    (Path(v.path) / "data.bin").write_bytes(payload)
    snap = manager.snapshots.create_snapshot("snap", v.volume_id, {})
    assert "readonly" in sh("btrfs", "property", "get", "-ts", snap.path, "ro") or "ro=true" in sh(
        "btrfs", "property", "get", "-ts", snap.path, "ro"
    )
    (Path(v.path) / "data.bin").write_bytes(b"changed")
    r = manager.create_volume(
        "restored",
        capacity_range=CapacityRange(128 * MIB),
        access_type="mount",
        source=VolumeSource("snapshot", snap.snapshot_id),
    )
    assert (Path(r.path) / "data.bin").read_bytes() == payload
    (Path(r.path) / "writable").write_text("yes")  # a restore is a writable snapshot
    c = manager.create_volume(
        "clone", capacity_range=CapacityRange(64 * MIB), access_type="mount", source=VolumeSource("volume", v.volume_id)
    )
    assert (Path(c.path) / "data.bin").read_bytes() == b"changed"
    # the restored volume got its own limit
    with pytest.raises(OSError) as e:
        write(Path(r.path) / "big", 160 * MIB, bytes(MIB))
    assert e.value.errno == errno.EDQUOT
    for x in (v, r, c):
        manager.delete_volume(x.volume_id)
    manager.snapshots.delete_snapshot(snap.snapshot_id)
    left = sh("btrfs", "subvolume", "list", str(manager.backends["btrfs"].base.parent))
    assert "nodeplug-csi" not in left


def test_block_and_ext4_volumes_are_reflinked_loop_files(manager: VolumeManager) -> None:
    blk = manager.create_volume("blk", capacity_range=CapacityRange(64 * MIB), access_type="block")
    assert blk.path.endswith(".img") and os.stat(blk.path).st_size == 64 * MIB
    with open(blk.path, "r+b") as f:
        f.write(os.urandom(32 * MIB))
        os.fsync(f.fileno())
    sh("btrfs", "filesystem", "sync", blk.path)
    free_before = fileops.free_bytes(Path(blk.path).parent)
    snap = manager.snapshots.create_snapshot("blk-snap", blk.volume_id, {})
    assert fileops.free_bytes(Path(blk.path).parent) > free_before - 8 * MIB  # shared extents, not a copy
    with open(blk.path, "rb") as a, open(snap.path, "rb") as b:
        assert a.read() == b.read()
    r = manager.create_volume(
        "blk-r",
        capacity_range=CapacityRange(64 * MIB),
        access_type="block",
        source=VolumeSource("snapshot", snap.snapshot_id),
    )
    with open(r.path, "rb") as a, open(snap.path, "rb") as b:
        assert a.read() == b.read()
    ext4 = manager.create_volume(
        "e", capacity_range=CapacityRange(32 * MIB), access_type="mount", fs_type="ext4", backend="btrfs"
    )
    assert not ext4.is_subvolume and "ext4" in sh("blkid", "-o", "value", "-s", "TYPE", ext4.path)
    tmp = Path(blk.path).parent / "probe"
    tmp.write_bytes(b"x" * 8192)
    try:
        assert fileops.copy_file(tmp, tmp.with_name("probe2")) == "reflink"
    finally:
        tmp.unlink()
        tmp.with_name("probe2").unlink()


def test_capacity_counts_promised_space(manager: VolumeManager) -> None:
    before = manager.get_capacity({"backend": "btrfs"})
    assert 0 < before < 512 * MIB
    v = manager.create_volume("promise", capacity_range=CapacityRange(128 * MIB), access_type="mount")
    after = manager.get_capacity({"backend": "btrfs"})
    assert before - after >= 120 * MIB
    write(Path(v.path) / "used", 32 * MIB)
    sh("btrfs", "filesystem", "sync", v.path)
    manager.delete_volume(v.volume_id)
    assert manager.get_capacity({}) >= before - 8 * MIB  # default backend here is btrfs


def test_group_snapshot_of_subvolumes(manager: VolumeManager) -> None:
    ids = []
    for i in range(2):
        v = manager.create_volume(f"g{i}", capacity_range=CapacityRange(16 * MIB), access_type="mount")
        (Path(v.path) / "n").write_text(str(i))
        ids.append(v.volume_id)
    g, snaps = manager.snapshots.create_group_snapshot("grp", ids, {})
    for s in snaps:
        assert (Path(s.path) / "n").read_text() == str(ids.index(s.source_volume_id))
    manager.snapshots.delete_group_snapshot(g.group_snapshot_id, list(g.snapshot_ids))
    assert not any(os.path.exists(s.path) for s in snaps)


def test_condition_of_a_lost_subvolume(manager: VolumeManager) -> None:
    v = manager.create_volume("lost", capacity_range=CapacityRange(16 * MIB), access_type="mount")
    assert not manager.volume_condition(v.volume_id).abnormal
    sh("btrfs", "subvolume", "delete", v.path)
    cond = manager.volume_condition(v.volume_id)
    assert cond.abnormal and "missing" in cond.message
    manager.delete_volume(v.volume_id)  # what is gone is deleted
    assert manager.list_volumes()[0] == []


def test_refuses_a_path_that_is_not_btrfs(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(FailedPrecondition, match="not btrfs"):
        BtrfsBackend(tmp_path / "plain").ready()
