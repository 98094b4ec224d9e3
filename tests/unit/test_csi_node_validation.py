"""Node-side request checks and host-table parsing that need no root: paths, flags, capabilities, sizes, mountinfo."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from csi.errors import InvalidArgument
from csi.loopdev import device_of_number, devices_of
from csi.mounts import MountEntry, fs_problem, fs_size, parse_mountinfo
from csi.node import capability
from csi.nodehost import parse_size
from csi.noderequests import MOUNT_TARGET, STAGING_SHAPES, TARGET_SHAPES, checked_flags, checked_path
from nodeplug.api.csi.v1 import csi_pb2

Cap = csi_pb2.VolumeCapability


@pytest.fixture
def kubelet(tmp_path: Path) -> Path:
    d = tmp_path / "var" / "lib" / "kubelet"
    (d / "pods").mkdir(parents=True)
    return d


def test_checked_path_accepts_kubelets_shapes(kubelet: Path) -> None:
    p = kubelet / "pods" / "uid" / "volumes" / "kubernetes.io~csi" / "pv" / "mount"
    assert checked_path("target_path", str(p), kubelet, TARGET_SHAPES) == (p, MOUNT_TARGET)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("", "target_path: required field is missing"),
        ("relative/path", "expected an absolute path"),
        ("/etc/passwd", "expected a path inside"),
        ("{k}/pods/../../../../etc", "must not contain '..'"),
        ("{k}", "expected a path inside"),
    ],
)
def test_checked_path_rejects(kubelet: Path, value: str, needle: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        checked_path("target_path", value.format(k=kubelet), kubelet, TARGET_SHAPES)
    assert needle in str(e.value)
    assert e.value.code == "INVALID_ARGUMENT"


def test_checked_path_resolves_symlinks_out_of_kubelet_dir(kubelet: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, kubelet / "pods" / "escape")
    with pytest.raises(InvalidArgument, match="after resolving symlinks"):
        checked_path("staging_target_path", str(kubelet / "pods" / "escape" / "x"), kubelet, STAGING_SHAPES)


def test_checked_path_optional_field(kubelet: Path) -> None:
    assert checked_path("staging_target_path", "", kubelet, STAGING_SHAPES, required=False) is None


def test_mount_flags() -> None:
    assert checked_flags(["noatime", "discard", "commit=30"]) == ("noatime", "discard", "commit=30")
    for bad in ["bind", "remount", "a,b", "x y", "", "loop=/dev/loop0"]:
        with pytest.raises(InvalidArgument, match=r"mount_flags\[0\]"):
            checked_flags([bad])


def test_capability_parsing() -> None:
    req = csi_pb2.NodeStageVolumeRequest()
    with pytest.raises(InvalidArgument, match="volume_capability: required field is missing"):
        capability(req)
    assert capability(req, required=False)[0] == ""
    req.volume_capability.CopyFrom(Cap(access_mode=Cap.AccessMode(mode=Cap.AccessMode.SINGLE_NODE_WRITER)))
    with pytest.raises(InvalidArgument, match="access_type"):
        capability(req)
    req.volume_capability.mount.CopyFrom(Cap.MountVolume(fs_type="xfs", mount_flags=["noatime"]))
    assert capability(req) == ("mount", "xfs", ("noatime",), Cap.AccessMode.SINGLE_NODE_WRITER)
    req.volume_capability.block.CopyFrom(Cap.BlockVolume())
    assert capability(req)[0] == "block"
    req.volume_capability.access_mode.mode = Cap.AccessMode.UNKNOWN
    with pytest.raises(InvalidArgument, match=r"access_mode\.mode"):
        capability(req)


def test_parse_size() -> None:
    assert parse_size("64Mi") == 64 << 20
    assert parse_size("1Gi") == 1 << 30
    assert parse_size("1000") == 1000
    assert parse_size("2G") == 2 * 10**9
    with pytest.raises(InvalidArgument, match=r"volume_context\.size"):
        parse_size("lots")


MOUNTINFO = (
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro\n"
    "40 22 7:3 / /var/lib/kubelet/plugins/kubernetes.io/csi/x/globalmount rw,relatime - ext4 /dev/loop3 rw\n"
    "41 22 7:3 / /var/lib/kubelet/pods/p/volumes/with\\040space ro,nosuid,relatime shared:5 - ext4 /dev/loop3 rw\n"
    "42 22 0:6 /loop4 /var/lib/kubelet/pods/p/volumeDevices/dev ro,relatime - devtmpfs devtmpfs rw,mode=755\n"
    "43 22 7:5 / /mnt/broken rw - ext4 /dev/loop5 ro\n"
)


def test_parse_mountinfo() -> None:
    entries = parse_mountinfo(MOUNTINFO)
    assert len(entries) == 5
    e = entries[2]
    assert e.mount_point == "/var/lib/kubelet/pods/p/volumes/with space"
    assert e.readonly and "nosuid" in e.options
    assert (e.fs_type, e.source, e.dev) == ("ext4", "/dev/loop3", "7:3")
    assert entries[3].root == "/loop4" and entries[3].fs_type == "devtmpfs"
    assert entries[0].super_options == ("rw", "errors=remount-ro")


def test_fs_problem_reports_ext4_errors_and_remount_ro(tmp_path: Path) -> None:
    entries = parse_mountinfo(MOUNTINFO)
    sysfs = tmp_path / "sys" / "fs"
    (sysfs / "ext4" / "loop3").mkdir(parents=True)
    (sysfs / "ext4" / "loop3" / "errors_count").write_text("0\n")
    ok = MountEntry(**{**entries[1].__dict__, "mount_point": str(tmp_path)})
    assert fs_problem(ok, sys_fs=sysfs) is None
    (sysfs / "ext4" / "loop3" / "errors_count").write_text("3\n")
    assert "recorded 3 error(s)" in (fs_problem(ok, sys_fs=sysfs) or "")
    broken = MountEntry(**{**entries[4].__dict__, "mount_point": str(tmp_path)})
    assert "remounted read-only" in (fs_problem(broken, sys_fs=sysfs) or "")
    assert fs_problem(broken, expect_rw=False, sys_fs=sysfs) is None


def test_a_loop_device_is_not_a_files_on_the_name_sysfs_gives_alone(tmp_path: Path) -> None:
    """sysfs names a backing file by its path in the mount namespace it was attached from: another namespace's file
    (another node's on the same machine) can have the very same name. Whether a device holds this file is the
    kernel's answer (its device and inode); these devices are not attached to it (tests/node: real ones that are)."""
    backing = tmp_path / "vol.img"
    backing.write_bytes(b"")
    sys_block = tmp_path / "sys" / "block"
    for name, back, ro in [
        ("loop12", f"{backing} (deleted)", "1"),
        ("loop3", str(backing), "0"),
        ("loop4", "/elsewhere.img", "0"),
    ]:
        (sys_block / name / "loop").mkdir(parents=True)
        (sys_block / name / "loop" / "backing_file").write_text(back + "\n")
        (sys_block / name / "ro").write_text(ro + "\n")
    (sys_block / "loop7").mkdir()  # not attached: no loop/ directory
    assert devices_of(backing, sys_block) == []


@pytest.mark.skipif(not (shutil.which("mkfs.ext4") and shutil.which("mkfs.xfs")), reason="needs e2fsprogs, xfsprogs")
def test_fs_size_from_superblock(tmp_path: Path) -> None:
    ext4, xfs = tmp_path / "e.img", tmp_path / "x.img"
    for img, size in ((ext4, 64 << 20), (xfs, 320 << 20)):
        with open(img, "wb") as f:
            f.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(ext4)], check=True, capture_output=True)
    subprocess.run(["mkfs.xfs", "-q", "-f", str(xfs)], check=True, capture_output=True)
    os.truncate(ext4, 128 << 20)  # the file grew, the filesystem did not
    assert fs_size(ext4, "ext4") == 64 << 20
    assert fs_size(xfs, "xfs") == 320 << 20
    assert fs_size(xfs, "ext4") is None and fs_size(tmp_path / "missing", "xfs") is None


def test_a_device_number_is_looked_up_in_sysfs_once(tmp_path: Path) -> None:
    devices = tmp_path / "sys" / "devices" / "virtual" / "block"
    dev_block = tmp_path / "sys" / "dev" / "block"
    dev_block.mkdir(parents=True)
    (devices / "loop7" / "loop").mkdir(parents=True)
    (devices / "loop7" / "loop" / "backing_file").write_text("/data/vol.img (deleted)\n")
    (devices / "sda").mkdir(parents=True)  # not a loop device: no loop/ directory
    os.symlink(devices / "loop7", dev_block / "7:7")
    os.symlink(devices / "sda", dev_block / "8:0")
    assert device_of_number(os.makedev(7, 7), dev_block) == ("/dev/loop7", "/data/vol.img")
    assert device_of_number(os.makedev(8, 0), dev_block) is None
    assert device_of_number(os.makedev(7, 9), dev_block) is None
