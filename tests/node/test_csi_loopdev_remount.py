"""A loop device is found again after the mount its backing file was opened through is gone.

The agent runs in a container whose mount of the host's state directory ends with it; after a restart (a rolling
update), the kernel names the backing file of every loop device the previous agent attached by its path below that
mount only (``/csi/volumes/<id>.img``). The volume's device must still be found, or unstaging leaves it attached and
deleting the volume leaks it."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi import holders, loopdev
from csi.model import Volume

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loop devices, mount namespaces")


@pytest.fixture
def attached_through_a_gone_mount(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A file in tmp_path with a loop device attached to it through a bind mount in a mount namespace that is gone."""
    state = tmp_path / "state"
    (state / "csi" / "volumes").mkdir(parents=True)
    backing = state / "csi" / "volumes" / "vol-1.img"
    with open(backing, "wb") as f:
        f.truncate(1 << 20)
    mnt = tmp_path / "container-view"
    mnt.mkdir()
    script = f"mount --bind {state} {mnt} && losetup -f --show {mnt}/csi/volumes/vol-1.img"
    dev = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                         text=True, timeout=30, check=True).stdout.strip()  # fmt: skip
    try:
        yield backing, dev
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=30, check=False)


def test_the_device_is_found_by_the_file_it_is_attached_to(attached_through_a_gone_mount: tuple[Path, str]) -> None:
    backing, dev = attached_through_a_gone_mount
    named = Path(f"/sys/block/{Path(dev).name}/loop/backing_file").read_text().strip()
    assert named == "/csi/volumes/vol-1.img", "the kernel names it below the gone mount"
    assert loopdev.rw_device(backing) == dev
    assert loopdev.devices_of(backing) == [(dev, False)]


def test_a_file_of_the_same_name_elsewhere_is_not_matched(
    attached_through_a_gone_mount: tuple[Path, str], tmp_path: Path
) -> None:
    other = tmp_path / "other" / "csi" / "volumes" / "vol-1.img"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"\0" * 4096)
    assert loopdev.devices_of(other) == []


def test_a_mount_of_the_device_is_known_as_the_volumes(
    attached_through_a_gone_mount: tuple[Path, str], tmp_path: Path
) -> None:
    """NodeUnpublish and NodeUnstage after an agent restart: the filesystem mounted from the device is this volume's
    (else kubelet's unmount waits forever on a target the driver no longer recognises)."""
    backing, dev = attached_through_a_gone_mount
    subprocess.run(["mkfs.ext4", "-q", dev], capture_output=True, timeout=60, check=True)
    target = tmp_path / "target"
    target.mkdir()
    subprocess.run(["mount", dev, str(target)], capture_output=True, timeout=30, check=True)
    try:
        volume = Volume("vol-1", "pvc-1", 1 << 20, "loopfile", "mount", "ext4", str(backing))
        assert holders.holds(volume, backing, target)
        other = tmp_path / "other.img"
        other.write_bytes(b"\0" * 4096)
        assert not holders.holds(volume, other, target)
    finally:
        subprocess.run(["umount", str(target)], capture_output=True, timeout=30, check=False)


@pytest.fixture
def same_path_in_another_namespace(tmp_path: Path) -> Iterator[tuple[Path, str, str]]:
    """Two nodes on one machine: this namespace's file at ``state/csi/volumes/vol-1.img``, and another mount
    namespace (kept alive meanwhile) that mounts a directory of its own at ``state``, with a file of the same name.
    A loop device attached to each, through its own namespace: sysfs names both backing files alike."""
    state = tmp_path / "state"
    (state / "csi" / "volumes").mkdir(parents=True)
    other = tmp_path / "other-node"
    (other / "csi" / "volumes").mkdir(parents=True)
    ours = state / "csi" / "volumes" / "vol-1.img"
    for f in (ours, other / "csi" / "volumes" / "vol-1.img"):
        with open(f, "wb") as out:
            out.truncate(1 << 20)
    script = f"mount --bind {other} {state} && losetup -f --show {ours} && exec sleep 60"
    node = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    theirs = ""
    own = ""
    try:
        assert node.stdout is not None
        theirs = node.stdout.readline().strip()
        assert theirs.startswith("/dev/loop"), "the other namespace attached no device"
        own = subprocess.run(["losetup", "-f", "--show", str(ours)], capture_output=True, text=True, timeout=30,
                             check=True).stdout.strip()  # fmt: skip
        yield ours, own, theirs
    finally:
        node.kill()
        node.communicate(timeout=30)  # reaps it and closes its pipes
        for dev in (own, theirs):
            if dev:
                subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=30, check=False)


def test_another_namespaces_device_of_the_same_path_is_never_ours(
    same_path_in_another_namespace: tuple[Path, str, str],
) -> None:
    """Each node's agent finds its loop devices by its volumes' paths under /var/lib/nodeplug, the same path on every
    node: one node must never reuse (write through), detach or count another node's device."""
    ours, own, theirs = same_path_in_another_namespace
    names = {Path(f"/sys/block/{Path(d).name}/loop/backing_file").read_text().strip() for d in (own, theirs)}
    assert names == {str(ours)}, "the kernel names both devices' backing files alike"
    assert loopdev.devices_of(ours) == [(own, False)]
    assert loopdev.rw_device(ours) == own
    assert loopdev.attach(ours) == (own, False)
    subprocess.run(["losetup", "-d", own], capture_output=True, timeout=30, check=True)
    assert loopdev.rw_device(ours) is None  # theirs is still attached, and still not ours
