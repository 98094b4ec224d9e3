"""Expansion is node-only: the driver advertises no controller EXPAND_VOLUME (so external-resizer only records the
new size, whichever node it runs on) and NodeExpandVolume alone, on the volume's node, grows the backing file and the
filesystem, as kubelet calls it after such a resizer."""

from __future__ import annotations

import os

import grpc
import pytest

from nodeplug.api.csi.v1 import csi_pb2

from support.csidriver import MiB, cap, expect, running_driver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")
Cap = csi_pb2.ControllerServiceCapability.RPC


async def test_expansion_is_advertised_on_the_node_only() -> None:
    async with running_driver() as d:
        ctl = await d.controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest())
        assert Cap.EXPAND_VOLUME not in {c.rpc.type for c in ctl.capabilities}
        plugin = await d.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
        expansion = [c.volume_expansion.type for c in plugin.capabilities if c.HasField("volume_expansion")]
        assert expansion == [csi_pb2.PluginCapability.VolumeExpansion.ONLINE]


@pytest.mark.parametrize("access", ["xfs", "block"])
async def test_node_expand_alone_grows_backing_and_filesystem(access: str) -> None:
    size, new = 320 * MiB, 640 * MiB
    fs = "" if access == "block" else access
    async with running_driver() as d:
        vid = (await d.create("pvc-node-grow", size, fs=fs, block=access == "block")).volume_id
        await d.stage(vid, fs=fs, block=access == "block")
        target = await d.publish(vid, fs=fs, block=access == "block")
        req = csi_pb2.NodeExpandVolumeRequest(
            volume_id=vid,
            volume_path=str(target),
            staging_target_path=str(d.staging(vid)),
            capacity_range=csi_pb2.CapacityRange(required_bytes=new),
            volume_capability=cap(fs=fs, block=access == "block"),
        )
        resp = await d.node.NodeExpandVolume(req)
        assert resp.capacity_bytes >= new
        backing = [p for p in (d.root / "var/lib/nodeplug/csi").rglob(f"{vid}*") if p.is_file()]
        assert backing and backing[0].stat().st_size >= new
        if access == "block":
            assert (await d.stats(vid, target)).usage[0].total >= new
        else:
            st = os.statvfs(target)
            assert st.f_blocks * st.f_frsize > size * 1.5
        # The volume's record says so too (what CreateSnapshot, GetCapacity and a restart go by).
        listed = await d.controller.ListVolumes(csi_pb2.ListVolumesRequest())
        assert {e.volume.volume_id: e.volume.capacity_bytes for e in listed.entries}[vid] >= new
        await d.take_down(vid, target)


async def test_node_expand_at_a_path_the_volume_is_not_at_grows_nothing() -> None:
    """The path is checked before the backing file grows: NOT_FOUND, and the file and the record keep their size."""
    async with running_driver() as d:
        vol = await d.create("pvc-node-grow-elsewhere", 320 * MiB, fs="ext4")
        vid, size = vol.volume_id, vol.capacity_bytes
        await d.stage(vid, fs="ext4")
        elsewhere = d.target(vid)  # the shape of a target, but nothing was published there
        req = csi_pb2.NodeExpandVolumeRequest(
            volume_id=vid,
            volume_path=str(elsewhere),
            capacity_range=csi_pb2.CapacityRange(required_bytes=640 * MiB),
            volume_capability=cap(fs="ext4"),
        )
        await expect(d.node.NodeExpandVolume(req), grpc.StatusCode.NOT_FOUND, "not staged or published at")
        backing = [p for p in (d.root / "var/lib/nodeplug/csi").rglob(f"{vid}*") if p.is_file()]
        assert backing and backing[0].stat().st_size == size
        listed = await d.controller.ListVolumes(csi_pb2.ListVolumesRequest())
        assert {e.volume.volume_id: e.volume.capacity_bytes for e in listed.entries}[vid] == size
        await d.unstage(vid)
        await d.delete(vid)


async def test_node_expand_with_a_block_capability_for_a_filesystem_volume_is_refused() -> None:
    """The capability must match the volume: a block one for a filesystem volume would report the new size with the
    filesystem left as it was."""
    async with running_driver() as d:
        vid = (await d.create("pvc-node-grow-kind", 64 * MiB, fs="ext4")).volume_id
        staging = await d.stage(vid, fs="ext4")
        req = csi_pb2.NodeExpandVolumeRequest(
            volume_id=vid,
            volume_path=str(staging),
            capacity_range=csi_pb2.CapacityRange(required_bytes=128 * MiB),
            volume_capability=cap(block=True),
        )
        await expect(d.node.NodeExpandVolume(req), grpc.StatusCode.FAILED_PRECONDITION, "access type block")
        await d.unstage(vid)
        await d.delete(vid)
