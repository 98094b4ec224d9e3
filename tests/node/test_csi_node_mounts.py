"""csi.mounts on real loop devices and filesystems: mount, bind (read-only, flags), unmount, stats, health."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from csi import mounts
from nodeplug.commands import CommandError

from support.host import sh

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")


@pytest.fixture
def ext4(loop_device: Callable[[int], str], tmp_path: Path, mounts_tracked: Callable[[Path], Path]) -> tuple[str, Path]:
    dev = loop_device(64 << 20)
    sh("mkfs.ext4", "-q", dev)
    mnt = mounts_tracked(tmp_path / "stage")
    mnt.mkdir()
    return dev, mnt


@pytest.fixture
def mounts_tracked(mounts: Callable[[Path], Path]) -> Callable[[Path], Path]:
    return mounts


def test_mount_bind_readonly_and_unmount(
    ext4: tuple[str, Path], tmp_path: Path, mounts_tracked: Callable[[Path], Path]
) -> None:
    dev, stage = ext4
    assert not mounts.is_mounted(stage)
    mounts.mount(dev, stage, "ext4", ["noatime"])
    entry = mounts.find_mount(stage)
    assert entry is not None and entry.fs_type == "ext4" and entry.source == dev and "noatime" in entry.options
    (stage / "f").write_text("data")

    target = mounts_tracked(tmp_path / "target with space")
    target.mkdir()
    mounts.bind_mount(stage, target, readonly=True, flags=["nosuid", "noexec"])
    t = mounts.find_mount(target)
    assert t is not None and t.readonly and {"nosuid", "noexec"} <= set(t.options) and t.dev == entry.dev
    assert (target / "f").read_text() == "data"
    with pytest.raises(OSError) as e:
        (target / "g").write_text("x")
    assert e.value.errno == errno.EROFS
    assert [m.mount_point for m in mounts.mounts_under(tmp_path)] == [str(stage), str(target)]

    stats = mounts.fs_stats(target)
    assert 50 << 20 < stats.total_bytes <= 64 << 20
    assert stats.used_bytes > 0 and stats.available_bytes < stats.total_bytes
    assert stats.total_inodes > stats.free_inodes > 0
    assert mounts.fs_problem(t, expect_rw=False) is None

    assert mounts.unmount(target) is True
    assert mounts.unmount(target) is False  # idempotent
    assert mounts.unmount(stage) is True
    assert not mounts.is_mounted(stage) and not mounts.is_mounted(target)


def test_fs_problem_sees_kernel_remount_readonly(ext4: tuple[str, Path]) -> None:
    dev, stage = ext4
    mounts.mount(dev, stage, "ext4")
    sh("mount", "-o", "remount,ro", str(stage))  # what errors=remount-ro does to the superblock
    entry = mounts.find_mount(stage)
    assert entry is not None
    assert "remounted read-only" in (mounts.fs_problem(entry) or "")
    mounts.unmount(stage)


def test_block_size_of_a_device(loop_device: Callable[[int], str]) -> None:
    dev = loop_device(32 << 20)
    assert mounts.block_size(dev) == 32 << 20


def test_mount_failure_names_command(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(CommandError) as e:
        mounts.mount(tmp_path / "nope", tmp_path / "m", "ext4")
    assert "'mount -t ext4" in str(e.value)
