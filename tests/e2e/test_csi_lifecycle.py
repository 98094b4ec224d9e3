"""Whole volume lifecycles through the CSI socket: both access types, both backends, restarts, reboots, ephemeral
inline volumes, stats and condition, online expansion. Real loop devices, mkfs and mounts."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from pathlib import Path

import grpc
import pytest
from grpc import aio

from csi.config import BtrfsConfig, Config
from nodeplug.api.csi.v1 import csi_pb2

from support.csidriver import MiB, cap, running_driver
from support.host import sh

Cap = csi_pb2.VolumeCapability

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")


def is_mount(path: Path) -> bool:
    return os.path.ismount(path)


def write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())


def block_write(dev: Path, data: bytes, offset: int = 0) -> None:
    fd = os.open(dev, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def block_read(dev: Path, n: int, offset: int = 0) -> bytes:
    fd = os.open(dev, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("fs", "size"), [("ext4", 64 * MiB), ("xfs", 320 * MiB)])
async def test_filesystem_lifecycle(fs: str, size: int) -> None:
    async with running_driver() as d:
        vol = await d.create("pvc-fs", size, fs=fs)
        vid = vol.volume_id
        staging = await d.stage(vid, fs=fs)
        await d.stage(vid, fs=fs)  # identical repeat: OK
        target = await d.publish(vid, fs=fs)
        await d.publish(vid, fs=fs)  # identical repeat: OK
        assert target.is_dir() and is_mount(target) and is_mount(staging)
        write(target / "hello", b"world")
        assert (staging / "hello").read_bytes() == b"world"

        stats = await d.stats(vid, target)
        by_unit = {u.unit: u for u in stats.usage}
        b = by_unit[csi_pb2.VolumeUsage.BYTES]
        assert size * 0.7 < b.total <= size and 0 < b.used < b.total and 0 < b.available < b.total
        assert by_unit[csi_pb2.VolumeUsage.INODES].total > 0
        assert not stats.volume_condition.abnormal

        await d.unpublish(vid, target)
        assert not target.exists()  # the driver removes what it created
        await d.unpublish(vid, target)  # gone already: OK
        await d.unstage(vid)
        await d.unstage(vid)  # gone already: OK
        assert d.mounts_under_root() == [] and d.loops_under_root() == []
        await d.delete(vid)


async def test_block_lifecycle_and_readonly_device() -> None:
    async with running_driver() as d:
        vid = (await d.create("pvc-block", 64 * MiB, block=True)).volume_id
        await d.stage(vid, block=True)
        rw = await d.publish(vid, pod="writer", block=True)
        assert stat.S_ISBLK(rw.stat().st_mode) and is_mount(rw)
        block_write(rw, b"B" * 4096, 1 * MiB)
        ro = await d.publish(vid, pod="reader", block=True, readonly=True, mode=Cap.AccessMode.MULTI_NODE_READER_ONLY)
        assert block_read(ro, 4096, 1 * MiB) == b"B" * 4096
        await d.publish(vid, pod="writer", block=True)  # repeat, with a read-only device now attached too
        block_write(rw, b"C" * 4096, 2 * MiB)  # still the writable device
        assert block_read(ro, 4096, 2 * MiB) == b"C" * 4096
        with pytest.raises(OSError) as e:
            block_write(ro, b"x" * 512)
        assert e.value.errno in (errno.EROFS, errno.EPERM, errno.EACCES)
        stats = await d.stats(vid, rw)
        assert [(u.unit, u.total) for u in stats.usage] == [(csi_pb2.VolumeUsage.BYTES, 64 * MiB)]
        assert len(d.loops_under_root()) == 2  # the staged device and the read-only one
        await d.unpublish(vid, ro)
        await d.unpublish(vid, rw)
        assert not rw.exists() and not ro.exists() and len(d.loops_under_root()) == 1
        await d.unstage(vid)
        assert d.loops_under_root() == [] and d.mounts_under_root() == []
        await d.delete(vid)


async def test_readonly_publish_and_mount_flags() -> None:
    async with running_driver() as d:
        vid = (await d.create("pvc-ro")).volume_id
        await d.stage(vid)
        target = await d.publish(vid, readonly=True, flags=("noexec", "nosuid"))
        with pytest.raises(OSError) as e:
            write(target / "x", b"x")
        assert e.value.errno == errno.EROFS
        opts = sh("findmnt", "-no", "OPTIONS", str(target))
        assert {"ro", "noexec", "nosuid"} <= set(opts.strip().split(","))
        for other in ({"readonly": False}, {"readonly": True, "flags": ("noexec",)}, {"readonly": True, "block": True}):
            with pytest.raises(aio.AioRpcError) as err:
                await d.publish(vid, **other)  # same target, other parameters
            code = err.value.code()
            assert code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION), other
        await d.unpublish(vid, target)
        await d.unstage(vid)


async def test_restart_between_every_step() -> None:
    async with running_driver() as d:
        vid = (await d.create("pvc-restart")).volume_id
        await d.restart()
        await d.stage(vid)
        await d.restart()
        assert d.plugin is not None and d.plugin.missing == []  # the staged device and mount are found again
        target = await d.publish(vid)
        write(target / "f", b"kept")
        await d.restart()
        assert d.plugin is not None and d.plugin.missing == []
        await d.publish(vid)  # a repeat after restart is still idempotent
        assert (await d.stats(vid, target)).volume_condition.abnormal is False
        await d.unpublish(vid, target)
        await d.restart()
        await d.unstage(vid)
        await d.restart()
        staging = await d.stage(vid)
        assert (staging / "f").read_bytes() == b"kept"
        await d.unstage(vid)
        await d.delete(vid)


async def test_reboot_loses_mounts_and_loop_devices_and_stage_restores_them() -> None:
    async with running_driver() as d:
        vid = (await d.create("pvc-reboot")).volume_id
        await d.stage(vid)
        target = await d.publish(vid)
        write(target / "f", b"survives")
        await d.stop()
        d.cleanup_host()  # the reboot: every mount and loop device is gone, the state stays
        await d.start()
        assert d.plugin is not None and any(vid in line for line in d.plugin.missing)
        stats = await d.stats(vid, target)
        assert stats.volume_condition.abnormal and "mount" in stats.volume_condition.message
        await d.stage(vid)  # kubelet stages and publishes again after the reboot
        await d.publish(vid)
        assert (target / "f").read_bytes() == b"survives"
        await d.take_down(vid, target)


async def test_ephemeral_inline_volume() -> None:
    async with running_driver() as d:
        target = d.target("csi-e1a2b3", pod="inline")
        req = csi_pb2.NodePublishVolumeRequest(
            volume_id="csi-e1a2b3",
            target_path=str(target),
            volume_capability=cap(),
            volume_context={"csi.storage.k8s.io/ephemeral": "true", "size": "32Mi"},
        )
        await d.node.NodePublishVolume(req)
        await d.node.NodePublishVolume(req)  # idempotent
        write(target / "scratch", b"tmp")
        ro = csi_pb2.NodePublishVolumeRequest()
        ro.CopyFrom(req)
        ro.readonly = True
        with pytest.raises(aio.AioRpcError) as err:  # an incompatible repeat fails and leaves the volume alone
            await d.node.NodePublishVolume(ro)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert (target / "scratch").read_bytes() == b"tmp"
        stats = await d.stats("csi-e1a2b3", target)
        assert 20 * MiB < stats.usage[0].total <= 32 * MiB
        assert d.plugin is not None and d.plugin.store is not None
        assert d.plugin.store.get_volume_by_name("csi-e1a2b3") is not None
        await d.unpublish("csi-e1a2b3", target)
        assert not target.exists() and d.mounts_under_root() == [] and d.loops_under_root() == []
        assert d.plugin.store.get_volume_by_name("csi-e1a2b3") is None  # unpublish deleted it
        assert not any(p.is_file() for p in (d.root / "var/lib/nodeplug/csi").rglob("*vol-*"))


async def test_condition_reports_missing_backing_file() -> None:
    async with running_driver() as d:
        vid = (await d.create("pvc-cond")).volume_id
        await d.stage(vid)
        target = await d.publish(vid)
        assert not (await d.stats(vid, target)).volume_condition.abnormal
        backing = [p for p in (d.root / "var/lib/nodeplug/csi").rglob("*") if vid in p.name and p.is_file()]
        assert backing, "the volume's backing file is under the data dir"
        backing[0].unlink()  # the loop device keeps the deleted file open; the volume is lost all the same
        cond = (await d.stats(vid, target)).volume_condition
        assert cond.abnormal and "missing" in cond.message and str(backing[0]) in cond.message
        await d.unpublish(vid, target)  # tearing down a broken volume still works
        await d.unstage(vid)
        assert d.mounts_under_root() == [] and d.loops_under_root() == []
        await d.delete(vid)


def has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        eff = next(line for line in f if line.startswith("CapEff:")).split()[1]
    return bool(int(eff, 16) >> 24 & 1)


@pytest.mark.parametrize(("fs", "size"), [("ext4", 64 * MiB), ("xfs", 320 * MiB)])
async def test_online_expansion_keeps_data(fs: str, size: int) -> None:
    async with running_driver() as d:
        vid = (await d.create("pvc-grow", size, fs=fs)).volume_id
        await d.stage(vid, fs=fs)
        target = await d.publish(vid, fs=fs)
        payload = os.urandom(1 * MiB)
        write(target / "data", payload)
        before = (await d.stats(vid, target)).usage[0].total
        new = size * 2
        ctl = await d.controller.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(
                volume_id=vid, capacity_range=csi_pb2.CapacityRange(required_bytes=new), volume_capability=cap(fs=fs)
            )
        )
        assert ctl.capacity_bytes >= new and ctl.node_expansion_required
        req = csi_pb2.NodeExpandVolumeRequest(
            volume_id=vid,
            volume_path=str(target),
            staging_target_path=str(d.staging(vid)),
            capacity_range=csi_pb2.CapacityRange(required_bytes=new),
            volume_capability=cap(fs=fs),
        )
        if fs == "ext4" and not has_cap_sys_resource():
            # the kernel refuses EXT4_IOC_RESIZE_FS without CAP_SYS_RESOURCE: a clear INTERNAL, nothing broken
            with pytest.raises(aio.AioRpcError) as err:
                await d.node.NodeExpandVolume(req)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "resize2fs" in (err.value.details() or "") and "CAP_SYS_RESOURCE" in (err.value.details() or "")
            assert (target / "data").read_bytes() == payload
            await d.unpublish(vid, target)
            await d.unstage(vid)
            return
        resp = await d.node.NodeExpandVolume(req)
        assert resp.capacity_bytes >= new
        after = (await d.stats(vid, target)).usage[0].total
        assert after > before * 1.8
        assert (target / "data").read_bytes() == payload
        await d.take_down(vid, target)


async def test_block_expansion_refreshes_loop_size() -> None:
    async with running_driver() as d:
        vid = (await d.create("pvc-bgrow", 64 * MiB, block=True)).volume_id
        await d.stage(vid, block=True)
        dev = await d.publish(vid, block=True)
        await d.controller.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(
                volume_id=vid, capacity_range=csi_pb2.CapacityRange(required_bytes=128 * MiB)
            )
        )
        resp = await d.node.NodeExpandVolume(
            csi_pb2.NodeExpandVolumeRequest(volume_id=vid, volume_path=str(dev), volume_capability=cap(block=True))
        )
        assert resp.capacity_bytes == 128 * MiB
        assert (await d.stats(vid, dev)).usage[0].total == 128 * MiB
        await d.take_down(vid, dev)


async def test_btrfs_subvolume_lifecycle(btrfs_root: Path) -> None:
    mnt = btrfs_root / "mnt" / "btrfs"
    config = Config(btrfs=BtrfsConfig(enabled=True, path="/mnt/btrfs"))
    async with running_driver(config, btrfs_root) as d:  # its teardown unmounts everything under root
        vid = (await d.create("pvc-btrfs", 64 * MiB, fs="btrfs", backend="btrfs")).volume_id
        staging = await d.stage(vid, fs="btrfs")
        target = await d.publish(vid, fs="btrfs")
        write(target / "f", b"cow")
        assert (staging / "f").read_bytes() == b"cow"
        stats = await d.stats(vid, target)
        assert stats.usage[0].total == 64 * MiB and not stats.volume_condition.abnormal
        assert 0 < stats.usage[0].used < 64 * MiB
        await d.unpublish(vid, target)
        await d.unstage(vid)
        assert d.mounts_under_root() == [str(mnt)]
        await d.delete(vid)

        # block mode on the btrfs backend: a loop file on the btrfs
        bid = (await d.create("pvc-btrfs-block", 32 * MiB, block=True, backend="btrfs")).volume_id
        await d.stage(bid, block=True)
        dev = await d.publish(bid, block=True)
        block_write(dev, b"R" * 4096, 4096)
        assert block_read(dev, 4096, 4096) == b"R" * 4096
        assert (await d.stats(bid, dev)).usage[0].total == 32 * MiB
        await d.unpublish(bid, dev)
        await d.unstage(bid)
        assert d.loops_under_root() == []
        await d.delete(bid)


async def test_many_volumes_at_once() -> None:
    async with running_driver() as d:

        async def up(i: int) -> tuple[str, Path]:
            vid = (await d.create(f"pvc-many-{i}", 16 * MiB)).volume_id
            await d.stage(vid)
            return vid, await d.publish(vid, pod=f"pod{i}")

        published = await asyncio.gather(*(up(i) for i in range(12)))
        assert len({t for _, t in published}) == 12 and len(d.loops_under_root()) == 12

        async def down(vid: str, target: Path) -> None:
            await d.take_down(vid, target)

        await asyncio.gather(*(down(v, t) for v, t in published))
        assert d.mounts_under_root() == [] and d.loops_under_root() == []


@pytest.mark.parametrize(("fs", "size"), [("ext4", 64 * MiB), ("xfs", 320 * MiB)])
async def test_expansion_while_unstaged_is_finished_by_stage(fs: str, size: int) -> None:
    """csi-sanity's order: ControllerExpandVolume first, then stage and publish, then NodeExpandVolume."""
    async with running_driver() as d:
        vid = (await d.create("pvc-offline", size, fs=fs)).volume_id
        staging = await d.stage(vid, fs=fs)
        write(staging / "data", b"before growth")
        await d.unstage(vid)
        await d.controller.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(
                volume_id=vid, capacity_range=csi_pb2.CapacityRange(required_bytes=2 * size)
            )
        )
        await d.stage(vid, fs=fs)  # finds the device larger than its filesystem and grows it
        target = await d.publish(vid, fs=fs)
        assert (await d.stats(vid, target)).usage[0].total > size * 1.3
        resp = await d.node.NodeExpandVolume(
            csi_pb2.NodeExpandVolumeRequest(
                volume_id=vid, volume_path=str(target), capacity_range=csi_pb2.CapacityRange(required_bytes=2 * size)
            )
        )
        assert resp.capacity_bytes == 2 * size
        assert (target / "data").read_bytes() == b"before growth"
        await d.take_down(vid, target)


async def test_restart_thaws_a_filesystem_a_crash_left_frozen() -> None:
    async with running_driver() as d:
        vid = (await d.create("frozen-at-crash")).volume_id
        staging = await d.stage(vid)
        sh("fsfreeze", "-f", str(staging))  # what a kill -9 in the middle of a snapshot copy leaves
        await d.restart()
        # a frozen filesystem would block this write forever; the timeout turns that into a failure
        proc = await asyncio.create_subprocess_exec("touch", str(staging / "after-restart"))
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        await d.unstage(vid)
        await d.delete(vid)


async def test_stage_formats_a_blank_volume_as_creation_does() -> None:
    """A volume whose file holds no filesystem at stage (its bytes wiped) is formatted with the options CreateVolume
    uses: no blocks reserved for root, so the whole capacity is the pod's."""
    async with running_driver() as d:
        vid = (await d.create("pvc-blank", 64 * MiB, fs="ext4")).volume_id
        backing = next(p for p in (d.root / "var/lib/nodeplug/csi").rglob(f"{vid}*") if p.is_file())
        size = backing.stat().st_size
        os.truncate(backing, 0)
        os.truncate(backing, size)
        staging = await d.stage(vid, fs="ext4")
        source = sh("findmnt", "-n", "-o", "SOURCE", "--mountpoint", str(staging)).strip()
        info = sh("tune2fs", "-l", source)
        assert "Reserved block count:     0" in info, info
        await d.unstage(vid)
        await d.delete(vid)
