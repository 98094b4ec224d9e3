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
