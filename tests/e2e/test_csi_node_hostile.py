"""The Node service against hostile or careless callers, through the socket, on real loop devices and mounts.

Each request field is attacker-controlled: another volume's staging path or target, kubelet's own directories and
files, mount options that hand the mount to other users. The driver acts only on paths with kubelet's shapes and on
mounts and files that are provably this volume's (or that it created), and a failed stage undoes itself.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest

from nodeplug.api.csi.v1 import csi_pb2

from support.csidriver import Driver, cap, expect

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def stage_req(volume_id: str, staging: Path, **kw: object) -> csi_pb2.NodeStageVolumeRequest:
    return csi_pb2.NodeStageVolumeRequest(
        volume_id=volume_id, staging_target_path=str(staging), volume_capability=kw.pop("capability", None) or cap()
    )


def publish_req(volume_id: str, staging: Path, target: Path, block: bool = False) -> csi_pb2.NodePublishVolumeRequest:
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id, staging_target_path=str(staging), target_path=str(target), volume_capability=cap(block)
    )


def unpublish_req(volume_id: str, target: Path) -> csi_pb2.NodeUnpublishVolumeRequest:
    return csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))


def mounted(path: Path) -> bool:
    return os.path.ismount(path)


def deleted_backing_files() -> list[str]:
    out = subprocess.run(["losetup", "-n", "-O", "BACK-FILE", "-l"], capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if "npcsi" in line and "(deleted)" in line]


# ---------------------------------------------------------------- 1: another volume's mount is not this volume's


async def test_staging_onto_another_volumes_mount_is_refused_and_leaves_it_alone(csi_driver: Driver) -> None:
    d = csi_driver
    b = (await d.create("pvc-b")).volume_id
    staging_b = await d.stage(b)
    (staging_b / "secret").write_bytes(b"B's data")
    c = (await d.create("pvc-c")).volume_id

    await expect(d.node.NodeStageVolume(stage_req(c, staging_b)), grpc.StatusCode.ALREADY_EXISTS, "not volume " + c)
    thief = d.target(c, pod="thief")
    await expect(d.node.NodePublishVolume(publish_req(c, staging_b, thief)), grpc.StatusCode.FAILED_PRECONDITION)
    assert not thief.exists()
    await d.node.NodeUnstageVolume(  # C is not staged there: nothing to do, and B's mount stays
        csi_pb2.NodeUnstageVolumeRequest(volume_id=c, staging_target_path=str(staging_b))
    )
    assert mounted(staging_b) and (staging_b / "secret").read_bytes() == b"B's data"
    assert len(d.loops_under_root()) == 1  # B's; the refused stage of C attached nothing

    await d.stage(c)  # C in its own place works
    await d.unstage(c)
    await d.unstage(b)
    assert d.mounts_under_root() == [] and d.loops_under_root() == []


async def test_publishing_onto_another_volumes_target_is_refused(csi_driver: Driver) -> None:
    d = csi_driver
    b, c = (await d.create("pvc-b")).volume_id, (await d.create("pvc-c")).volume_id
    await d.stage(b)
    staging_c = await d.stage(c)
    target_b = await d.publish(b, pod="pod-b")
    (target_b / "mine").write_bytes(b"B")
    await expect(d.node.NodePublishVolume(publish_req(c, staging_c, target_b)), grpc.StatusCode.ALREADY_EXISTS)
    assert (target_b / "mine").read_bytes() == b"B"
    await d.unpublish(b, target_b)
    for v in (b, c):
        await d.unstage(v)


# ---------------------------------------------------------------- 2: unpublish acts only on what is this volume's


async def test_unpublish_leaves_other_volumes_and_kubelets_files_alone(csi_driver: Driver) -> None:
    d = csi_driver
    b = (await d.create("pvc-b")).volume_id
    staging_b = await d.stage(b)
    target_b = await d.publish(b, pod="pod-b")
    (target_b / "mine").write_bytes(b"B")
    c = (await d.create("pvc-c")).volume_id

    await d.node.NodeUnpublishVolume(unpublish_req(c, target_b))  # C is not published there: OK, nothing touched
    assert mounted(target_b) and (target_b / "mine").read_bytes() == b"B"
    await expect(d.node.NodeUnpublishVolume(unpublish_req(c, staging_b)), INVALID, "target_path")
    assert mounted(staging_b)
    for rel in ("config.yaml", "pki/kubelet.crt", "device-plugins/kubelet.sock", "pods/uid/etc-hosts"):
        kubelets = d.kubelet / rel
        kubelets.parent.mkdir(parents=True, exist_ok=True)
        kubelets.write_text("kubelet's")
        await expect(d.node.NodeUnpublishVolume(unpublish_req(c, kubelets)), INVALID, "target_path")
        assert kubelets.read_text() == "kubelet's"

    await d.unpublish(b, target_b)
    await d.unstage(b)
    assert d.mounts_under_root() == []


async def test_unpublish_never_removes_what_publish_did_not_create(csi_driver: Driver) -> None:
    d = csi_driver
    c = (await d.create("pvc-c")).volume_id
    planted = d.target(c, pod="pod-x")  # a file in a target's place, not made by the driver
    planted.write_text("not the driver's")
    await d.unpublish(c, planted)
    assert planted.read_text() == "not the driver's"

    await d.stage(c)
    existing = d.target(c, pod="pod-y")
    existing.mkdir()  # a target directory that was there before the publish
    await d.node.NodePublishVolume(publish_req(c, d.staging(c), existing))
    await d.unpublish(c, existing)
    assert existing.is_dir() and not mounted(existing)
    made = await d.publish(c, pod="pod-z")  # the driver creates this one, and removes it
    await d.unpublish(c, made)
    assert not made.exists()
    await d.unstage(c)

    blk = (await d.create("pvc-blk", block=True)).volume_id
    await d.stage(blk, block=True)
    kept = d.target(blk, pod="pod-b", block=True)
    kept.write_bytes(b"")  # kubelet's file (or anyone's) at the block target before the publish
    await d.node.NodePublishVolume(publish_req(blk, d.staging(blk), kept, block=True))
    await d.unpublish(blk, kept)
    assert kept.is_file() and not mounted(kept)
    await d.unstage(blk)
    assert d.mounts_under_root() == [] and d.loops_under_root() == []


# ---------------------------------------------------------------- 3: kubelet's shapes


@pytest.mark.parametrize(
    "rel",
    [
        "pods",
        "plugins",
        "pods/uid",
        "pods/uid/volumes",
        "pods/uid/volumes/kubernetes.io~csi",
        "pods/uid/volumes/kubernetes.io~csi/pv",
        "pods/uid/volumes/kubernetes.io~empty-dir/cache/mount",
        "plugins/kubernetes.io/csi",
        "plugins/local.csi.nodeplug.io/x/y/z",
        "plugins_registry/a/b/c/d/e",
        "device-plugins/a/b/c/d/e",
    ],
)
async def test_publish_targets_must_have_kubelets_shapes(csi_driver: Driver, rel: str) -> None:
    d = csi_driver
    vid = (await d.create("pvc-shape")).volume_id
    staging = await d.stage(vid)
    target = d.kubelet / rel
    target.mkdir(parents=True, exist_ok=True)
    await expect(d.node.NodePublishVolume(publish_req(vid, staging, target)), INVALID, "target_path")
    assert d.mounts_under_root() == [str(staging)]
    await d.unstage(vid)


async def test_shapes_are_judged_after_resolving_symlinks_and_by_access_type(csi_driver: Driver) -> None:
    d = csi_driver
    vid = (await d.create("pvc-shape")).volume_id
    staging = await d.stage(vid)
    disguised = d.target(vid, pod="pod-s")
    disguised.symlink_to(d.kubelet / "pods")  # kubelet's shape on the outside, kubelet's pods directory inside
    await expect(d.node.NodePublishVolume(publish_req(vid, staging, disguised)), INVALID, "resolved")
    block_place = d.target(vid, pod="pod-b", block=True)
    await expect(d.node.NodePublishVolume(publish_req(vid, staging, block_place)), INVALID, "pods/<pod>/volumes")
    assert d.mounts_under_root() == [str(staging)]
    for bad_staging in (d.kubelet / "pods" / "uid", d.kubelet / "plugins" / "elsewhere"):
        bad_staging.mkdir(parents=True, exist_ok=True)
        await expect(d.node.NodeStageVolume(stage_req(vid, bad_staging)), INVALID, "staging_target_path")
    await d.unstage(vid)


# ---------------------------------------------------------------- 4: a failed stage undoes itself; mount options


async def test_a_stage_whose_mount_fails_undoes_itself(csi_driver: Driver) -> None:
    d = csi_driver
    vid = (await d.create("pvc-badopt")).volume_id
    details = await expect(d.stage(vid, flags=("noatime", "nosuchoption")), INVALID, "mount_flags")
    assert "nosuchoption" in details
    assert d.loops_under_root() == [] and d.mounts_under_root() == []
    # a staging path whose directories do not exist yet: the driver makes them, and takes them back on failure
    before = sorted(d.kubelet.rglob("*"))
    fresh = d.kubelet / "plugins" / "kubernetes.io" / "csi" / "pv" / f"new-{vid}"
    request = stage_req(vid, fresh / "globalmount", capability=cap(flags=("nosuchoption",)))
    await expect(d.node.NodeStageVolume(request), INVALID, "nosuchoption")
    assert sorted(d.kubelet.rglob("*")) == before
    assert d.loops_under_root() == [] and d.mounts_under_root() == []
    await d.delete(vid)
    assert deleted_backing_files() == []  # no loop device keeps the deleted file's space


@pytest.mark.parametrize(
    "flag", ["user", "users", "owner", "group", "helper=foo", "uhelper=foo", "X-mount.mode=0777", "x-gvfs-show"]
)
async def test_options_that_change_who_may_use_the_mount_are_refused(csi_driver: Driver, flag: str) -> None:
    d = csi_driver
    vid = (await d.create("pvc-who")).volume_id
    await expect(d.stage(vid, flags=(flag,)), INVALID, "mount_flags[0]")
    assert d.loops_under_root() == [] and d.mounts_under_root() == []
