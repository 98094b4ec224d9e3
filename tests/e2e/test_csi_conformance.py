"""Node and Identity RPCs against the CSI spec's error-code tables and idempotency rules, through the socket.

The CSI v1.12 error tables of NodeStageVolume, NodeUnstageVolume, NodePublishVolume (and its second-
publish table for plugins with SINGLE_NODE_MULTI_WRITER), NodeUnpublishVolume, NodeGetVolumeStats,
NodeExpandVolume and Probe; required fields are INVALID_ARGUMENT naming the field; a second operation
in flight on a volume is ABORTED.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from nodeplug import __version__
from nodeplug.api.csi.v1 import csi_pb2

from support.csidriver import Driver, cap, expect

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")

Mode = csi_pb2.VolumeCapability.AccessMode
UNKNOWN_ID = "vol-00000000000000000000000000000000"


@pytest.fixture
def d(csi_driver: Driver) -> Driver:
    return csi_driver


async def staged_volume(d: Driver, name: str = "pvc-c") -> str:
    vid: str = (await d.create(name)).volume_id
    await d.stage(vid)
    return vid


# ---------------------------------------------------------------- missing and invalid fields

Req = Callable[[Driver, str], Any]

INVALID: list[tuple[str, str, Req, str]] = [
    ("NodeStageVolume", "no volume_id", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        staging_target_path=str(d.staging(v)), volume_capability=cap()), "volume_id"),
    ("NodeStageVolume", "no staging path", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        volume_id=v, volume_capability=cap()), "staging_target_path"),
    ("NodeStageVolume", "no capability", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        volume_id=v, staging_target_path=str(d.staging(v))), "volume_capability"),
    ("NodeStageVolume", "id with ..", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        volume_id="../../etc", staging_target_path=str(d.staging(v)), volume_capability=cap()), "volume_id"),
    ("NodeStageVolume", "path outside kubelet", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        volume_id=v, staging_target_path="/etc", volume_capability=cap()), "staging_target_path"),
    ("NodeStageVolume", "relative path", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        volume_id=v, staging_target_path="var/lib/kubelet/x", volume_capability=cap()), "staging_target_path"),
    ("NodeStageVolume", "bad mount flag", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        volume_id=v, staging_target_path=str(d.staging(v)), volume_capability=cap(flags=("remount",))),
     "mount_flags[0]"),
    ("NodeUnstageVolume", "no volume_id", lambda d, v: csi_pb2.NodeUnstageVolumeRequest(
        staging_target_path=str(d.staging(v))), "volume_id"),
    ("NodeUnstageVolume", "no staging path", lambda d, v: csi_pb2.NodeUnstageVolumeRequest(
        volume_id=v), "staging_target_path"),
    ("NodePublishVolume", "no volume_id", lambda d, v: csi_pb2.NodePublishVolumeRequest(
        staging_target_path=str(d.staging(v)), target_path=str(d.target(v)), volume_capability=cap()), "volume_id"),
    ("NodePublishVolume", "no target", lambda d, v: csi_pb2.NodePublishVolumeRequest(
        volume_id=v, staging_target_path=str(d.staging(v)), volume_capability=cap()), "target_path"),
    ("NodePublishVolume", "no capability", lambda d, v: csi_pb2.NodePublishVolumeRequest(
        volume_id=v, staging_target_path=str(d.staging(v)), target_path=str(d.target(v))), "volume_capability"),
    ("NodePublishVolume", "target escapes with ..", lambda d, v: csi_pb2.NodePublishVolumeRequest(
        volume_id=v, staging_target_path=str(d.staging(v)), target_path=f"{d.kubelet}/pods/../../../../tmp/x",
        volume_capability=cap()), "target_path"),
    ("NodeUnpublishVolume", "no volume_id", lambda d, v: csi_pb2.NodeUnpublishVolumeRequest(
        target_path=str(d.target(v))), "volume_id"),
    ("NodeUnpublishVolume", "no target", lambda d, v: csi_pb2.NodeUnpublishVolumeRequest(volume_id=v), "target_path"),
    ("NodeUnpublishVolume", "target outside kubelet", lambda d, v: csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=v, target_path="/"), "target_path"),
    ("NodeGetVolumeStats", "no volume_id", lambda d, v: csi_pb2.NodeGetVolumeStatsRequest(
        volume_path=str(d.staging(v))), "volume_id"),
    ("NodeGetVolumeStats", "no volume_path", lambda d, v: csi_pb2.NodeGetVolumeStatsRequest(volume_id=v),
     "volume_path"),
    ("NodeExpandVolume", "no volume_id", lambda d, v: csi_pb2.NodeExpandVolumeRequest(
        volume_path=str(d.staging(v))), "volume_id"),
    ("NodeExpandVolume", "no volume_path", lambda d, v: csi_pb2.NodeExpandVolumeRequest(volume_id=v), "volume_path"),
]  # fmt: skip


@pytest.mark.parametrize(("rpc", "why", "build", "field"), INVALID, ids=[f"{r}-{w}" for r, w, _, _ in INVALID])
async def test_invalid_argument_names_the_field(d: Driver, rpc: str, why: str, build: Req, field: str) -> None:
    vid = (await d.create("pvc-inv")).volume_id
    await expect(getattr(d.node, rpc)(build(d, vid)), grpc.StatusCode.INVALID_ARGUMENT, field)
    assert d.mounts_under_root() == [] and d.loops_under_root() == []  # nothing half-done


# ---------------------------------------------------------------- NOT_FOUND

NOT_FOUND: list[tuple[str, Req]] = [
    ("NodeStageVolume", lambda d, v: csi_pb2.NodeStageVolumeRequest(
        volume_id=UNKNOWN_ID, staging_target_path=str(d.staging(v)), volume_capability=cap())),
    ("NodeUnstageVolume", lambda d, v: csi_pb2.NodeUnstageVolumeRequest(
        volume_id=UNKNOWN_ID, staging_target_path=str(d.staging(v)))),
    ("NodePublishVolume", lambda d, v: csi_pb2.NodePublishVolumeRequest(
        volume_id=UNKNOWN_ID, staging_target_path=str(d.staging(v)), target_path=str(d.target(v)),
        volume_capability=cap())),
    ("NodeUnpublishVolume", lambda d, v: csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=UNKNOWN_ID, target_path=str(d.target(v)))),
    ("NodeGetVolumeStats", lambda d, v: csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=UNKNOWN_ID, volume_path=str(d.staging(v)))),
    ("NodeExpandVolume", lambda d, v: csi_pb2.NodeExpandVolumeRequest(
        volume_id=UNKNOWN_ID, volume_path=str(d.staging(v)))),
    # a volume that exists but is not at the path asked about
    ("NodeGetVolumeStats", lambda d, v: csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=v, volume_path=str(d.target(v, pod="elsewhere")))),
    ("NodeExpandVolume", lambda d, v: csi_pb2.NodeExpandVolumeRequest(
        volume_id=v, volume_path=str(d.target(v, pod="elsewhere")))),
    # stats and expansion only compare the path with their records: outside kubelet's dir it is just not there
    ("NodeGetVolumeStats", lambda d, v: csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=v, volume_path="/path/does/not/exist")),
    ("NodeGetVolumeStats", lambda d, v: csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=UNKNOWN_ID, volume_path="some/path")),
    ("NodeExpandVolume", lambda d, v: csi_pb2.NodeExpandVolumeRequest(volume_id=v, volume_path="/etc")),
]  # fmt: skip


@pytest.mark.parametrize(("rpc", "build"), NOT_FOUND, ids=[f"{r}-{i}" for i, (r, _) in enumerate(NOT_FOUND)])
async def test_not_found(d: Driver, rpc: str, build: Req) -> None:
    vid = await staged_volume(d)
    await expect(getattr(d.node, rpc)(build(d, vid)), grpc.StatusCode.NOT_FOUND)
    await d.unstage(vid)


# ---------------------------------------------------------------- stage / unstage rules


async def test_stage_rules(d: Driver) -> None:
    vid = await staged_volume(d)
    await d.stage(vid)  # same path, same capability: OK
    await expect(d.stage(vid, block=True), grpc.StatusCode.FAILED_PRECONDITION, "access type")
    await expect(d.stage(vid, fs="xfs"), grpc.StatusCode.FAILED_PRECONDITION, "ext4")
    await expect(d.stage(vid, flags=("noexec",)), grpc.StatusCode.ALREADY_EXISTS, "noexec")  # incompatible repeat
    other = d.kubelet / "plugins" / "kubernetes.io" / "csi" / "pv" / "elsewhere" / "globalmount"
    other.mkdir(parents=True)
    req = csi_pb2.NodeStageVolumeRequest(volume_id=vid, staging_target_path=str(other), volume_capability=cap())
    await expect(d.node.NodeStageVolume(req), grpc.StatusCode.FAILED_PRECONDITION, "already staged")

    target = await d.publish(vid)
    await expect(d.unstage(vid), grpc.StatusCode.FAILED_PRECONDITION, "still published")
    await d.unpublish(vid, target)
    await d.unstage(vid)
    await d.unstage(vid)  # not staged any more: OK


# ---------------------------------------------------------------- publish rules


async def test_publish_requires_staging(d: Driver) -> None:
    vid = (await d.create("pvc-p")).volume_id
    target = d.target(vid)
    no_staging = csi_pb2.NodePublishVolumeRequest(volume_id=vid, target_path=str(target), volume_capability=cap())
    await expect(d.node.NodePublishVolume(no_staging), grpc.StatusCode.FAILED_PRECONDITION, "staging_target_path")
    await expect(d.publish(vid), grpc.StatusCode.FAILED_PRECONDITION, "not staged")
    assert not target.exists()


async def test_second_publish_table(d: Driver) -> None:
    vid = await staged_volume(d)
    single = Mode.SINGLE_NODE_SINGLE_WRITER
    t1 = await d.publish(vid, pod="a", mode=single)
    await d.publish(vid, pod="a", mode=single)  # T1=T2, P1=P2: OK
    await expect(d.publish(vid, pod="a", mode=single, readonly=True), grpc.StatusCode.ALREADY_EXISTS)  # P1!=P2
    await expect(d.publish(vid, pod="b", mode=single), grpc.StatusCode.FAILED_PRECONDITION)  # T1!=T2
    await d.unpublish(vid, t1)

    multi = Mode.SINGLE_NODE_MULTI_WRITER
    t1 = await d.publish(vid, pod="a", mode=multi)
    t2 = await d.publish(vid, pod="b", mode=multi)  # T1!=T2 under SINGLE_NODE_MULTI_WRITER: OK
    t3 = await d.publish(vid, pod="c", mode=multi, readonly=True)  # T1!=T2, P1!=P2: OK
    for t in (t1, t2, t3):
        await d.unpublish(vid, t)
        await d.unpublish(vid, t)  # gone already: OK
        assert not t.exists()
    await d.unstage(vid)


async def test_operation_in_flight_is_aborted(d: Driver) -> None:
    vid = (await d.create("pvc-busy")).volume_id
    assert d.plugin is not None and d.plugin.manager is not None
    with d.plugin.manager.locks.hold(f"volume/{vid}"):  # e.g. a ControllerExpandVolume still running
        await expect(d.stage(vid), grpc.StatusCode.ABORTED, vid)
        await expect(d.unstage(vid), grpc.StatusCode.ABORTED)
    await d.stage(vid)
    await d.unstage(vid)


async def test_unpublish_of_a_never_published_target_is_ok(d: Driver) -> None:
    """Success (the RPC is idempotent) that made and removed nothing: no target, kubelet's directory left, and the
    volume still stages and publishes there."""
    vid = (await d.create("pvc-never")).volume_id
    target = d.target(vid)
    await d.unpublish(vid, target)
    assert not target.exists() and target.parent.is_dir()
    await d.stage(vid)
    assert await d.publish(vid) == target and target.is_mount()
    await d.unpublish(vid, target)
    await d.unstage(vid)


# ---------------------------------------------------------------- Identity


async def test_identity(d: Driver) -> None:
    info = await d.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == "local.csi.nodeplug.io" and info.vendor_version == __version__
    assert (await d.identity.Probe(csi_pb2.ProbeRequest())).ready.value is True
    caps = await d.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    assert len(caps.capabilities) == 4


async def test_ephemeral_volume_context_errors_name_the_key(d: Driver) -> None:
    target = d.target("csi-bad", pod="inline")
    for context, needle in [({"size": "huge"}, "volume_context.size"), ({"colour": "red"}, "volume_context.colour")]:
        req = csi_pb2.NodePublishVolumeRequest(
            volume_id="csi-bad",
            target_path=str(target),
            volume_capability=cap(),
            volume_context={"csi.storage.k8s.io/ephemeral": "true", **context},
        )
        await expect(d.node.NodePublishVolume(req), grpc.StatusCode.INVALID_ARGUMENT, needle)
    assert not target.exists() and d.loops_under_root() == []
