"""Offline ext4 growth on its own (csi.offlinegrow), with the real e2fsprogs: a grow fills its file; a grow whose
resize2fs is killed before one of its writes (strace's fault injection, through a resize2fs first on PATH) leaves
its marker, and the next grow repairs and finishes it with the data intact; a filesystem mounted anywhere is never
touched. The whole agent's side of it (stage, expand, a kill -9 of the agent) is tests/e2e/test_csi_offline_grow.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from csi import offlinegrow
from csi.errors import Internal

MiB = 1 << 20
GiB = 1 << 30
RESIZE2FS = shutil.which("resize2fs") or "/usr/sbin/resize2fs"


def ext4_with_data(path: Path, size: int, data: bytes) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard,lazy_itable_init=1", str(path)], check=True)
    src = path.with_suffix(".data")
    src.write_bytes(data)
    subprocess.run(["debugfs", "-w", "-R", f"write {src} data", str(path)], capture_output=True, check=True)


def data_of(path: Path) -> bytes:
    out = path.with_suffix(".out")
    subprocess.run(["debugfs", "-R", f"dump data {out}", str(path)], capture_output=True, check=True)
    return out.read_bytes()


def size_of(path: Path) -> int:
    out = subprocess.run(["dumpe2fs", "-h", str(path)], capture_output=True, text=True, check=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return int(info["Block count"]) * int(info["Block size"])


def clean(path: Path) -> bool:
    return subprocess.run(["e2fsck", "-f", "-n", str(path)], capture_output=True, check=False).returncode == 0


def test_a_grow_fills_the_file_and_leaves_no_marker(tmp_path: Path) -> None:
    img, marker = tmp_path / "vol.img", tmp_path / "grow" / "vol.growing"
    data = os.urandom(MiB)
    ext4_with_data(img, 64 * MiB, data)
    os.truncate(img, 256 * MiB)
    assert offlinegrow.grow(img, marker) is False  # nothing was interrupted
    assert size_of(img) == 256 * MiB and clean(img) and data_of(img) == data
    assert not marker.exists()


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed (scripts/setup installs it)")
@pytest.mark.parametrize("write", [1, 10, 100, 250, 400])
def test_a_grow_killed_before_any_write_is_finished_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: int
) -> None:
    """16 MiB (1 KiB blocks) grown to 24 GiB: resize2fs makes about 445 writes; killed before the given one."""
    img, marker = tmp_path / "vol.img", tmp_path / "grow" / "vol.growing"
    data = os.urandom(4 * MiB)
    ext4_with_data(img, 16 * MiB, data)
    os.truncate(img, 24 * GiB)
    killer = tmp_path / "bin"
    killer.mkdir()
    (killer / "resize2fs").write_text(
        "#!/bin/sh\nexec strace -o /dev/null -e trace=pwrite64 "
        f'-e inject=pwrite64:signal=KILL:when={write} {RESIZE2FS} "$@"\n'
    )
    (killer / "resize2fs").chmod(0o755)
    with monkeypatch.context() as m:
        m.setenv("PATH", f"{killer}:{os.environ['PATH']}")
        with pytest.raises(Internal, match="growing the filesystem"):
            offlinegrow.grow(img, marker)
    assert offlinegrow.interrupted(marker)
    assert offlinegrow.grow(img, marker) is True  # repaired (e2fsck -f -p), then grown
    assert size_of(img) == 24 * GiB and clean(img) and data_of(img) == data
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a loop device and a mount")
def test_a_mounted_filesystem_is_never_grown_offline(tmp_path: Path) -> None:
    img, mnt = tmp_path / "vol.img", tmp_path / "mnt"
    ext4_with_data(img, 32 * MiB, b"x")
    os.truncate(img, 64 * MiB)
    mnt.mkdir()
    dev = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True, check=True).stdout
    dev = dev.strip()
    try:
        subprocess.run(["mount", dev, str(mnt)], check=True)
        try:
            with pytest.raises(offlinegrow.Busy, match="still in use"):
                offlinegrow.grow(Path(dev), tmp_path / "vol.growing")
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
        assert size_of(Path(dev)) == 32 * MiB and not (tmp_path / "vol.growing").exists()  # untouched
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
