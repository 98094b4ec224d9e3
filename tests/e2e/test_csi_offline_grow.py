"""ext4 volumes grow without CAP_SYS_RESOURCE where they can: the whole agent (CSI only, no API server) on a temporary
root, driven over its CSI socket in the order a kubelet that expands right after staging uses for a claim expanded
while no pod used it (node-only expansion: the next pod's NodeStageVolume, then NodeExpandVolume at the staging
path, then NodePublishVolume; kubelet 1.32 publishes first, and the volume is grown at stage from its PV, which the
cluster tier proves). Nothing but the agent's own staging mount holds the volume then, so its filesystem is grown
offline (unmounted: e2fsck -f, resize2fs), which this machine's root can do although it cannot grow a mounted ext4.
A volume a pod has published is grown online, never unmounted under the pod. And a kill -9 of the agent (with the
commands it runs) in the middle of resize2fs leaves a volume that the next NodeStageVolume stages, repaired and
grown, data intact.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from csi.config import Config
from nodeplug.api.csi.v1 import csi_pb2

from lab.host import answers
from support.agent import AgentProcess
from support.csidriver import DRIVER, Driver, MiB, cap, cleanup_under
from support.wait import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loop devices and mounts")]

ONLY_CSI = "deviceplugin:\n  enabled: false\ncni:\n  enabled: false\n"
GiB = 1 << 30


def has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


class Node:
    """The agent on one root, restartable, and a kubelet-shaped CSI client for it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.agent: AgentProcess | None = None
        self.d = Driver(root, Config())

    async def start(self) -> None:
        await self.d.stop()  # the channel to an earlier agent, if any
        self.agent = AgentProcess(self.root, ONLY_CSI, own_group=True)
        sock = self.root / f"var/lib/kubelet/plugins/{DRIVER}/csi.sock"
        self.agent.wait_healthy()
        agent = self.agent
        wait_for("the CSI socket answering", lambda: agent.alive() or answers(sock), 30)
        self.d.connect(sock)

    def kill(self) -> None:
        assert self.agent is not None
        self.agent.kill_group()

    def log(self) -> str:
        return (self.root / "agent.log").read_text()


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="npg-", dir="/tmp"))
    n = Node(root)
    try:
        await n.start()
        yield n
    finally:
        await n.d.stop()
        if n.agent is not None and n.agent.proc.poll() is None:
            n.agent.kill_group()
        cleanup_under(root)
        shutil.rmtree(root, ignore_errors=True)


def mount_options(path: Path) -> tuple[str, ...]:
    """The per-mount options of the mount at ``path``."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        if f[4] == str(path):
            return tuple(f[5].split(","))
    raise AssertionError(f"nothing mounted at {path}")


def size_of(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


async def expand(d: Driver, vid: str, path: Path, size: int) -> int:
    resp = await d.node.NodeExpandVolume(
        csi_pb2.NodeExpandVolumeRequest(
            volume_id=vid,
            volume_path=str(path),
            staging_target_path=str(d.staging(vid)),
            capacity_range=csi_pb2.CapacityRange(required_bytes=size),
            volume_capability=cap(fs="ext4"),
        )
    )
    return int(resp.capacity_bytes)


async def used_then_left(d: Driver, name: str, size: int) -> tuple[str, str]:
    """A claim's volume a first pod wrote to and left (unpublished, unstaged); returns its id and the data's hash."""
    vid = (await d.create(name, size, fs="ext4")).volume_id
    await d.stage(vid, fs="ext4")
    target = await d.publish(vid, fs="ext4")
    data = os.urandom(1 << 20)
    (target / "data").write_bytes(data)
    os.sync()
    await d.unpublish(vid, target)
    await d.unstage(vid)
    return vid, hashlib.sha256(data).hexdigest()


async def test_a_volume_expanded_while_unused_is_seen_grown_by_the_next_pod(node: Node) -> None:
    d = node.d
    vid, digest = await used_then_left(d, "pvc-offline-grow", 64 * MiB)
    # the next pod: stage (with a mount flag, which the grown volume keeps), expand at the staging path, publish
    staging = await d.stage(vid, fs="ext4", flags=("noatime",))
    assert await expand(d, vid, staging, 256 * MiB) >= 256 * MiB
    assert "grown offline" in node.log()  # unmounted, grown, mounted again as it was:
    assert "noatime" in mount_options(staging) and size_of(staging) > 200 * MiB
    target = await d.publish(vid, "pod2", fs="ext4")
    assert size_of(target) > 200 * MiB
    assert hashlib.sha256((target / "data").read_bytes()).hexdigest() == digest
    stats = await d.stats(vid, target)
    assert not stats.volume_condition.abnormal and stats.usage[0].total > 200 * MiB
    assert not list((node.root / "var/lib/nodeplug/csi/grow").glob("*.growing"))  # done: no marker left
    await d.take_down(vid, target)


async def test_a_volume_a_pod_uses_is_grown_online_never_unmounted(node: Node) -> None:
    d = node.d
    vid = (await d.create("pvc-online-grow", 64 * MiB, fs="ext4")).volume_id
    await d.stage(vid, fs="ext4")
    target = await d.publish(vid, fs="ext4")
    busy = await asyncio.to_thread((target / "busy").open, "wb")  # the pod, writing
    try:
        call = expand(d, vid, target, 128 * MiB)
        if has_cap_sys_resource():
            assert await call >= 128 * MiB and size_of(target) > 100 * MiB
        else:  # this sandbox: the online ioctl is refused, and the error says what would make it work
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.INTERNAL and "CAP_SYS_RESOURCE" in (e.value.details() or "")
        busy.write(b"still here")
    finally:
        busy.close()
    assert (target / "busy").read_bytes() == b"still here"  # the pod's mount was never taken away
    assert "grown offline" not in node.log()
    await d.take_down(vid, target)


def stopped_resize2fs(group: int) -> bool:
    """A resize2fs of the agent's process group is stopped (where the test's strace stopped it, half-way)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if argv[0].endswith(b"resize2fs") and fields[0] in ("t", "T") and int(fields[2]) == group:
                return True
    return False


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed (scripts/setup installs it)")
async def test_a_kill_during_the_offline_grow_leaves_a_volume_that_stages_next_time(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent runs a resize2fs that strace stops before its 200th write (of about 400: 16 MiB with 1 KiB blocks
    grown to 20 GiB); the agent is killed with it there, as a node kills a container."""
    d = node.d
    vid, digest = await used_then_left(d, "pvc-grow-killed", 16 * MiB)
    stopper = node.root / "bin"
    stopper.mkdir()
    (stopper / "resize2fs").write_text(
        "#!/bin/sh\nexec strace -o /dev/null -e trace=pwrite64 "
        f'-e inject=pwrite64:signal=STOP:when=200 {shutil.which("resize2fs")} "$@"\n'
    )
    (stopper / "resize2fs").chmod(0o755)
    node.kill()
    with monkeypatch.context() as m:
        m.setenv("PATH", f"{stopper}:{os.environ['PATH']}")
        await node.start()  # this agent's resize2fs stops half-way
    staging = await d.stage(vid, fs="ext4")
    call = asyncio.create_task(expand(d, vid, staging, 20 * GiB))
    assert node.agent is not None
    group = node.agent.proc.pid
    await asyncio.to_thread(wait_for, "resize2fs stopped half-way", lambda: stopped_resize2fs(group), 60)
    node.kill()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    marker = node.root / f"var/lib/nodeplug/csi/grow/{vid}.growing"
    assert marker.exists()  # the grow was under way
    # kubelet retries: the restarted agent stages the volume (repairing and finishing the grow), then expands
    await node.start()
    staging = await d.stage(vid, fs="ext4")
    assert "finished a filesystem growth a kill interrupted" in node.log() and not marker.exists()
    assert await expand(d, vid, staging, 20 * GiB) >= 20 * GiB
    target = await d.publish(vid, fs="ext4")
    assert size_of(target) > 18 * GiB
    assert hashlib.sha256((target / "data").read_bytes()).hexdigest() == digest
    await d.unpublish(vid, target)
    await d.unstage(vid)
    backing = next(p for p in (node.root / "var/lib/nodeplug/csi/volumes").iterdir() if vid in p.name)
    check = await asyncio.to_thread(
        subprocess.run, ["e2fsck", "-f", "-n", str(backing)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr  # a clean filesystem, nothing for e2fsck to fix
    await d.delete(vid)
