"""A disk that stops answering writes, for the tests that prove the event loop does not wait on the disk.

``slow_disk(directory)`` mounts a small ext4 filesystem (a sparse file on a loop device) on ``directory``;
:meth:`SlowDisk.frozen` freezes it with ``fsfreeze(8)``: every write, create, rename and fsync on it then blocks in
the kernel until it is thawed, while reads, ``stat`` and lookups go on (a disk that stopped answering writes, as an
overloaded or failing one does). Nothing of FUSE, device-mapper or a fake file API is needed.

Safety: a thread stuck on a frozen filesystem cannot be killed, so the filesystem is always thawed: at the end of the
``with`` block, at teardown, and by a watchdog process (its own session) after ``hang_bound`` seconds even if the
test process dies. At teardown the filesystem is unmounted and its loop device detached.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.host import IS_ROOT, sh


class SlowDisk:
    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self._watchdog: subprocess.Popen[bytes] | None = None

    @contextlib.contextmanager
    def frozen(self, hang_bound: float = 120) -> Iterator[None]:
        """Writes to the filesystem block for the block's duration (at most ``hang_bound`` seconds)."""
        sh("fsfreeze", "--freeze", str(self.mountpoint))
        self._watchdog = subprocess.Popen(
            ["sh", "-c", f'sleep {hang_bound}; exec fsfreeze --unfreeze "$0"', str(self.mountpoint)],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield
        finally:
            self.thaw()

    def thaw(self) -> None:
        sh("fsfreeze", "--unfreeze", str(self.mountpoint), check=False)  # an error when it was not frozen: fine
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait(10)
            self._watchdog = None


@pytest.fixture
def slow_disk(tmp_path: Path) -> Iterator[Callable[[Path], SlowDisk]]:
    """Factory: ``disk = slow_disk(directory)`` mounts a fresh 16 MiB ext4 filesystem on ``directory`` (made if
    absent); every one is thawed, unmounted and its loop device detached at teardown."""
    if not IS_ROOT:
        pytest.skip("needs root: mounts a loop device and freezes it")
    made: list[SlowDisk] = []

    def make(directory: Path) -> SlowDisk:
        image = tmp_path / f"slow-disk-{len(made)}.img"
        with open(image, "wb") as f:
            f.truncate(16 << 20)
        sh("mkfs.ext4", "-q", "-F", str(image))
        directory.mkdir(parents=True, exist_ok=True)
        sh("mount", "-o", "loop", str(image), str(directory))
        disk = SlowDisk(directory)
        made.append(disk)
        return disk

    yield make
    for disk in made:
        disk.thaw()
        sh("umount", str(disk.mountpoint), check=False)  # detaches the loop device mount made (autoclear)
        if os.path.ismount(disk.mountpoint):
            sh("umount", "-l", str(disk.mountpoint), check=False)
