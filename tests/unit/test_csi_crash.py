"""kill -9 in the middle of volume creation loses nothing and duplicates nothing.

A child process creates loop-file volumes in a loop and is killed with SIGKILL at a chosen step of a create; the store
reopened afterwards lists only complete volumes (file present, full size, formatted), and repeating every
CreateVolume the child may have started succeeds, replacing any leftover of the interrupted one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from csi.config import Config
from csi.model import derive_id
from csi.state import StateStore
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.paths import Root

from support.wait import running, wait_for

pytestmark = pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")

CHILD = """
import sys
from pathlib import Path
from csi.config import Config
from csi.state import StateStore
from csi.volumes import CapacityRange, VolumeManager
from nodeplug.paths import Root

root = Root(Path(sys.argv[1]))
cfg = Config(node_id="n1")
m = VolumeManager(StateStore(root(cfg.data_dir) / "state.db"), cfg, root=root)
for i in range(100000):
    print(i, flush=True)
    m.create_volume(f"pvc-{i}", capacity_range=CapacityRange(8 << 20), access_type="mount", fs_type="ext4")
"""


def _wait_for(path: Path, child: subprocess.Popen[str], timeout: float = 30.0) -> None:
    """Until ``path`` exists (the create in flight reached that step), polled finely: a step lasts milliseconds."""
    wait_for(f"{path.name} to appear", lambda: running(child) and os.path.lexists(path), timeout, interval=0.0005)


@pytest.mark.parametrize("moment", ["announced", "building", "renamed"])
def test_kill_9_during_creates(tmp_path: Path, moment: str) -> None:
    """Killed at a known step of a create in flight: as it starts, while its file is being built (a temporary file),
    and just after the file was renamed into place (before or as it is recorded)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    assert child.stdout is not None
    started = [int(child.stdout.readline()) for _ in range(3)]  # creating steadily by now (imports are slow)
    if moment != "announced":
        final = Root(tmp_path)(Config().data_dir) / "volumes" / f"{derive_id('vol', f'pvc-{started[-1] + 1}')}.img"
        _wait_for(final.with_name(f".tmp-{final.name}") if moment == "building" else final, child)
    os.kill(child.pid, signal.SIGKILL)
    out, _ = child.communicate(timeout=30)
    started += [int(line) for line in out.split()]

    cfg = Config(node_id="n1")
    store = StateStore(Root(tmp_path)(cfg.data_dir) / "state.db")
    m = VolumeManager(store, cfg, root=Root(tmp_path))
    recorded = m.list_volumes()[0]
    assert len(recorded) >= len(started) - 1  # only the one in flight may be missing
    for v in recorded:
        assert os.stat(v.path).st_size == 8 << 20
        with open(v.path, "rb") as f:
            f.seek(0x438)
            assert f.read(2) == b"\x53\xef"  # the ext4 superblock magic: the file was complete when recorded
    for i in started:  # the CO retries whatever it did not see finish
        v = m.create_volume(f"pvc-{i}", capacity_range=CapacityRange(8 << 20), access_type="mount", fs_type="ext4")
        assert os.stat(v.path).st_size == 8 << 20
    assert len(m.list_volumes()[0]) == len(started)
    assert m.unrecorded() == []  # the interrupted attempt's leftover was replaced, not leaked
    store.close()
