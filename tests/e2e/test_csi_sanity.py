"""The community's CSI conformance suite (csi-sanity, kubernetes-csi/csi-test) against the running agent.

``nodeplug agent`` runs with only its CSI driver on a temporary root; csi-sanity drives it through its socket with
staging and target paths in kubelet's shapes under the root's kubelet directory, in three modes: loop-file volumes
mounted, loop-file volumes as raw block devices, and btrfs subvolumes (a btrfs filesystem on a loop device of the
test's own). Every mode must end with 0 failed. The binary comes from ``$CSI_SANITY`` (default
``../shared/bin/csi-sanity`` next to the repository); the test skips, saying so, where it is absent.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.agent import AgentProcess
from support.csidriver import DRIVER, cleanup_under, loops_under, mounts_under
from support.host import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the driver creates loop devices and mounts")

CSI_SANITY = Path(os.environ.get("CSI_SANITY", REPO.parent / "shared" / "bin" / "csi-sanity"))
MiB = 1 << 20
SUMMARY = re.compile(r"(\d+) Passed \| (\d+) Failed \| (\d+) Pending \| (\d+) Skipped")
ONLY_CSI = "deviceplugin:\n  enabled: false\ncni:\n  enabled: false\n"


@pytest.fixture
def sanity() -> Path:
    if not (CSI_SANITY.is_file() and os.access(CSI_SANITY, os.X_OK)):
        pytest.skip(f"csi-sanity not found at {CSI_SANITY} (set CSI_SANITY to the binary)")
    return CSI_SANITY


@pytest.fixture
def csi_agent(spawn_agent: Callable[..., AgentProcess]) -> Iterator[Callable[..., AgentProcess]]:
    """Start the agent (CSI only) with extra config, on a given root or a new one; at teardown, whatever a failed
    run left mounted or attached under its root is taken down before the root is removed."""
    started: list[AgentProcess] = []

    def start(extra: str = "", root: Path | None = None) -> AgentProcess:
        agent = spawn_agent(root, extra_config=ONLY_CSI + extra)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            agent.stop()
        cleanup_under(agent.root)


def run_sanity(
    binary: Path, agent: AgentProcess, block: bool, params: dict[str, str] | None = None, size: int = 64 * MiB
) -> str:
    kubelet = agent.root / "var/lib/kubelet"
    staging = kubelet / "plugins/kubernetes.io/csi" / DRIVER / "sanity" / "globalmount"
    if block:
        mountdir = kubelet / "plugins/kubernetes.io/csi/volumeDevices/publish/sanity"  # targets: mountdir/target
    else:
        mountdir = kubelet / "pods/sanity/volumes/kubernetes.io~csi/sanity"
    staging.parent.mkdir(parents=True, exist_ok=True)  # csi-sanity makes the last component itself
    mountdir.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        str(binary),
        f"-csi.endpoint=unix://{kubelet}/plugins/{DRIVER}/csi.sock",
        f"-csi.stagingdir={staging}",
        f"-csi.mountdir={mountdir}",
        f"-csi.testvolumesize={size}",
        f"-csi.testvolumeexpandsize={2 * size}",
        f"-csi.testvolumeaccesstype={'block' if block else 'mount'}",
        "-ginkgo.no-color",
    ]
    if params:
        param_file = agent.root / "sanity-params.yaml"
        param_file.write_text("".join(f"{k}: {v}\n" for k, v in params.items()))
        argv.append(f"-csi.testvolumeparameters={param_file}")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    out = p.stdout + p.stderr
    summary = SUMMARY.search(out)
    assert summary is not None, f"csi-sanity gave no summary (exit {p.returncode}):\n{out[-4000:]}"
    passed, failed = int(summary[1]), int(summary[2])
    failures = "\n".join(line for line in out.splitlines() if "[FAIL]" in line)
    assert failed == 0 and p.returncode == 0, f"{summary[0]}\n{failures}\nagent log:\n{agent.log.read_text()[-3000:]}"
    assert passed >= 70, summary[0]  # the whole suite ran, not an early stop
    return summary[0]


CAP_SYS_RESOURCE = 24


def grows_ext4_online() -> bool:
    """Online ext4 growth (resize2fs on a mounted filesystem) needs CAP_SYS_RESOURCE, which the privileged DaemonSet
    has; a machine whose root lacks it (some sandboxes) can grow xfs online but not ext4."""
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(eff >> CAP_SYS_RESOURCE & 1)


@pytest.mark.parametrize("block", [False, True], ids=["mount", "block"])
def test_csi_sanity_loop_file_volumes(sanity: Path, csi_agent: Callable[..., AgentProcess], block: bool) -> None:
    # csi-sanity grows a published volume; where ext4 cannot grow online here, its filesystem volumes are xfs (whose
    # smallest filesystem is 300 MiB: smaller requests would be rounded up to it, and csi-sanity checks sizes).
    xfs = not block and not grows_ext4_online()
    agent = csi_agent("csi:\n  default_fs_type: xfs\n" if xfs else "")
    agent.wait_healthy()
    print(run_sanity(sanity, agent, block, size=320 * MiB if xfs else 64 * MiB))
    assert agent.stop() == 0
    assert mounts_under(agent.root) == [] and loops_under(agent.root) == []  # every volume taken down again


def test_csi_sanity_btrfs_subvolumes(btrfs_root: Path, sanity: Path, csi_agent: Callable[..., AgentProcess]) -> None:
    agent = csi_agent("csi:\n  btrfs:\n    enabled: true\n    path: /mnt/btrfs\n", btrfs_root)
    agent.wait_healthy()
    print(run_sanity(sanity, agent, block=False, params={"backend": "btrfs"}))
    assert agent.stop() == 0
    assert mounts_under(btrfs_root) == [str(btrfs_root / "mnt" / "btrfs")] and loops_under(btrfs_root) == []
