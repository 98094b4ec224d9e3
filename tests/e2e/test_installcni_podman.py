"""What the DaemonSet's init container installs, used by a real runtime: podman runs containers on the network of the
conflist ``nodeplug install-cni`` wrote, through the bundle it installed, and forgets it after ``--uninstall``.

The bundle is the real one (scripts/build-cni-bundle; cached under build/ by a hash of its sources, shared with
tests/node/test_installcni_chroot.py). podman 4.3 is confined as in tests/e2e/test_cni_podman.py: CNI backend,
plugin and config directories under the install root, vfs storage in a temp dir, a busybox root filesystem, and its
network namespace set to a test netns (nsenter), so bridges and veths never touch the root netns. The agent is not
running: the entry point works standalone.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cni import thick

from support.podman import needs_podman

pytestmark = [pytest.mark.e2e, *needs_podman]

REPO = Path(__file__).resolve().parents[2]
NETWORK, BRIDGE = "npinst", "npinst0"
SUBNET, GATEWAY = "10.88.66.0/24", "10.88.66.1"

NO_AGENT = "no-agent/cni.sock"  # under the test's tmp_path: the network's socket, served by no agent


@pytest.fixture(scope="module")
def bundle(cni_bundle: Path) -> Path:
    return cni_bundle


def install_cni(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nodeplug.cli", "install-cni", "--root", str(root), *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip


class Podman:
    def __init__(self, tmp: Path, host_netns: str, store: Path, install_root: Path) -> None:
        self.tmp, self.host_netns, self.store = tmp, host_netns, store
        self.rootfs = tmp / "rootfs"
        for d in ("bin", "proc", "sys", "dev", "etc", "tmp"):
            (self.rootfs / d).mkdir(parents=True)
        shutil.copy(shutil.which("busybox") or "/bin/busybox", self.rootfs / "bin/busybox")
        for applet in ("sh", "ip", "ping", "grep"):
            (self.rootfs / "bin" / applet).symlink_to("busybox")
        (tmp / "containers.conf").write_text(
            "[containers]\n"
            'default_ulimits = ["nofile=1024:20000", "nproc=1024:2048"]\n'
            "[network]\n"
            'network_backend = "cni"\n'
            f'cni_plugin_dirs = ["{install_root}/opt/cni/bin"]\n'
            f'network_config_dir = "{install_root}/etc/cni/net.d"\n'
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            f'events_logfile_path = "{tmp}/events.log"\n'
            'runtime = "runc"\n'
            f'tmp_dir = "{tmp}/libpod-tmp"\n'
            # conmon, and the podman it runs to clean up an exited container (DEL), get only these variables
            f'conmon_env_vars = ["PATH={os.environ["PATH"]}", "{thick.ENV_SOCKET}={tmp / NO_AGENT}"]\n'
        )
        (tmp / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{store}/graph"\nrunroot = "{store}/run"\n'
        )

    def run(self, *args: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "CONTAINERS_CONF": str(self.tmp / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.tmp / "storage.conf"),
            # podman's environment is its plugins': the launcher asks the config's socket, not the machine's default
            # (a real agent may serve that one)
            thick.ENV_SOCKET: str(self.tmp / NO_AGENT),
        }
        argv = ["nsenter", f"--net=/run/netns/{self.host_netns}", "podman",
                "--root", str(self.store / "graph"), "--runroot", str(self.store / "run"), *args]  # fmt: skip
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p


@pytest.fixture
def installed(tmp_path: Path, bundle: Path) -> Path:
    root = tmp_path / "host"
    p = install_cni(
        root, "--bundle", str(bundle), "--network-name", NETWORK, "--datapath", "bridge", "--bridge", BRIDGE,
        "--subnet", SUBNET,
        "--no-ip-masq", "--socket", str(tmp_path / NO_AGENT),
        "--ipam-data-dir", str(tmp_path / "ipam"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return root


@pytest.fixture
def podman(tmp_path: Path, netns: Callable[[], str], installed: Path) -> Iterator[Podman]:
    store = Path(tempfile.mkdtemp(prefix="np-pi-", dir="/tmp"))  # podman wants a short runroot
    pm = Podman(tmp_path, netns(), store, installed)
    yield pm
    pm.run("rm", "-a", "-f", "-t", "0", check=False)
    subprocess.run(["umount", "-R", "-l", str(store)], capture_output=True, check=False, timeout=30)
    shutil.rmtree(store, ignore_errors=True)


def test_a_container_runs_on_the_installed_network_until_it_is_uninstalled(
    podman: Podman, installed: Path, tmp_path: Path
) -> None:
    assert NETWORK in podman.run("network", "ls", "--format", "{{.Name}}").stdout.split()
    out = podman.run(
        "run", "--rm", "--network", NETWORK, "--rootfs", str(podman.rootfs),
        "/bin/sh", "-c", f"ip -o -4 addr show dev eth0 && ping -c 1 -W 2 {GATEWAY}",
    ).stdout  # fmt: skip
    (addr,) = [line.split()[3] for line in out.splitlines() if " inet " in line]
    assert ipaddress.ip_interface(addr).ip in ipaddress.ip_network(SUBNET)
    assert "1 packets received" in out
    # The container is gone: DEL ran through the bundle too (no veth left on the bridge's side).
    links = subprocess.run(["ip", "-n", podman.host_netns, "-j", "link", "show"], capture_output=True, text=True,
                           check=True, timeout=10).stdout  # fmt: skip
    names = {link["ifname"] for link in json.loads(links)}
    assert BRIDGE in names and not [n for n in names if n.startswith("veth")], names

    p = install_cni(installed, "--uninstall")
    assert p.returncode == 0, p.stderr
    assert not (installed / "opt/cni/bin/nodeplug").exists()
    assert NETWORK not in podman.run("network", "ls", "--format", "{{.Name}}").stdout.split()
    failed = podman.run("run", "--rm", "--network", NETWORK, "--rootfs", str(podman.rootfs), "/bin/true", check=False)
    assert failed.returncode != 0
