"""podman as the real CNI client: a container on a nodeplug network sees its address and reaches the gateway, and
removing it frees the lease.

podman 4.3 is forced onto its CNI backend with a containers.conf in a temp dir whose ``cni_plugin_dirs`` holds our
entry point as ``nodeplug`` (a wrapper executing the repo's ``.venv/bin/nodeplug-cni``) and the reference plugins;
storage (vfs) lives in the temp dir too, and the container runs from a busybox root filesystem directory. podman runs
with its network namespace set to a test netns (``nsenter --net``; ``ip netns exec`` would remount /sys and hide the
cgroup mounts runc needs), so the bridge, the veths and the forwarding sysctl never touch the root netns. The agent is
not running in the first tests (nothing serves the config's ``socket``), so the entry point works standalone; the
last one starts ``nodeplug agent`` (CNI plugin only, under a temp ``--root``, in the same test netns) and checks that
the agent did the work.
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

from support.podman import needs_podman
from support.processes import stop
from support.wait import running, wait_for

pytestmark = [pytest.mark.e2e, *needs_podman]

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / ".venv" / "bin" / "nodeplug-cni"
NETWORK = "npe2e"
BRIDGE = "npe2e0"
SUBNET4, GW4 = "10.88.77.0/24", "10.88.77.1"
SUBNET6, GW6 = "fd88:77::/64", "fd88:77::1"
APPLETS = ("sh", "ip", "ping", "cat", "sleep", "grep")


class Podman:
    """podman confined to a temp dir and a test host netns."""

    def __init__(self, tmp: Path, host_netns: str, store: Path, datapath: str = "bridge") -> None:
        self.tmp = tmp
        self.host_netns = host_netns
        self.datapath = datapath
        self.ipam_dir = tmp / "ipam"
        self.rootfs = tmp / "rootfs"
        self.store = store  # podman wants a runroot path of at most 50 characters
        self.agent_root = tmp / "agent-root"
        self.agent_socket = self.agent_root / "run" / "nodeplug" / "cni.sock"
        self._write_config()
        self._write_rootfs()

    def _write_config(self) -> None:
        bin_dir = self.tmp / "cni-bin"
        conf_dir = self.tmp / "net.d"
        bin_dir.mkdir()
        conf_dir.mkdir()
        wrapper = bin_dir / "nodeplug"
        wrapper.write_text(f'#!/bin/sh\nexec {ENTRY} "$@"\n')
        wrapper.chmod(0o755)
        (self.tmp / "containers.conf").write_text(
            "[containers]\n"
            'default_ulimits = ["nofile=1024:20000", "nproc=1024:2048"]\n'
            "[network]\n"
            'network_backend = "cni"\n'
            f'cni_plugin_dirs = ["{bin_dir}", "/usr/lib/cni"]\n'
            f'network_config_dir = "{conf_dir}"\n'
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            f'events_logfile_path = "{self.tmp}/events.log"\n'
            'runtime = "runc"\n'
            f'tmp_dir = "{self.tmp}/libpod-tmp"\n'
        )
        (self.tmp / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{self.store}/graph"\nrunroot = "{self.store}/run"\n'
        )
        conflist = {
            "cniVersion": "1.0.0",
            "name": NETWORK,
            "plugins": [
                {
                    "type": "nodeplug",
                    "bridge": BRIDGE,
                    "datapath": self.datapath,
                    "isGateway": True,
                    "isDefaultGateway": True,
                    "socket": str(self.agent_socket),
                    "ipam": {
                        "type": "nodeplug",
                        "ranges": [[{"subnet": SUBNET4}], [{"subnet": SUBNET6}]],
                        "dataDir": str(self.ipam_dir),
                    },
                }
            ],
        }
        (conf_dir / f"{NETWORK}.conflist").write_text(json.dumps(conflist))

    def _write_rootfs(self) -> None:
        for d in ("bin", "proc", "sys", "dev", "etc", "tmp"):
            (self.rootfs / d).mkdir(parents=True)
        shutil.copy(shutil.which("busybox") or "/bin/busybox", self.rootfs / "bin" / "busybox")
        for applet in APPLETS:
            (self.rootfs / "bin" / applet).symlink_to("busybox")

    def run(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        env = {
            **os.environ,
            "CONTAINERS_CONF": str(self.tmp / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.tmp / "storage.conf"),
        }
        argv = [
            "nsenter",
            f"--net=/run/netns/{self.host_netns}",
            "podman",
            "--root",
            str(self.store / "graph"),
            "--runroot",
            str(self.store / "run"),
            *args,
        ]
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p.stdout

    def leases(self) -> list[str]:
        """Addresses leased in the network's IPAM store (read through the store's own API, in a child process so
        this test process keeps no connection to the database)."""
        code = (
            "import json, sys\n"
            "from cni.ipam.sqlite import open_store\n"
            "with open_store(sys.argv[1], sys.argv[2]).transaction() as t:\n"
            "    print(json.dumps(sorted(lease.ip for lease in t.leases())))\n"
        )
        if not (self.ipam_dir / f"{NETWORK}.db").exists():
            return []
        out = subprocess.run(
            [sys.executable, "-c", code, str(self.ipam_dir), NETWORK],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
            timeout=30,
        )
        return list(json.loads(out.stdout))


@pytest.fixture
def podman(request: pytest.FixtureRequest, tmp_path: Path, netns: Callable[[], str]) -> Iterator[Podman]:
    """podman on a nodeplug network of the bridge datapath, or of the one a test's ``datapath`` parameter names."""
    if not ENTRY.exists():
        pytest.skip(f"the CNI entry point is not installed in the venv ({ENTRY}): run scripts/setup")
    store = Path(tempfile.mkdtemp(prefix="np-pm-", dir="/tmp"))
    pm = Podman(tmp_path, netns(), store, getattr(request, "param", "bridge"))
    if pm.datapath == "routed":  # the gateways' addresses become the node's own, for the containers to ping
        for addr in (f"{GW4}/32", f"{GW6}/128"):
            subprocess.run(["ip", "-n", pm.host_netns, "addr", "add", addr, "dev", "lo"], check=True)
    yield pm
    pm.run("rm", "-a", "-f", "-t", "0", check=False)
    # vfs layers are plain directories, but podman leaves some of them read-only or as mount points: let it go
    subprocess.run(["umount", "-R", "-l", str(pm.store)], capture_output=True, check=False)
    shutil.rmtree(store, ignore_errors=True)


@pytest.mark.parametrize("podman", ["bridge", "routed"], indirect=True)
def test_container_sees_its_addresses_and_reaches_the_gateway(podman: Podman) -> None:
    out = podman.run(
        "run", "--rm", "--network", NETWORK, "--rootfs", str(podman.rootfs),
        "/bin/sh", "-c",
        f"ip -o addr show dev eth0 && ip route && ip -6 route && ping -c 1 -W 2 {GW4} && ping -c 1 -W 2 {GW6}",
    )  # fmt: skip
    addrs = {line.split()[3] for line in out.splitlines() if " inet" in line}
    v4 = [a for a in addrs if ipaddress.ip_interface(a).version == 4]
    v6 = [a for a in addrs if ipaddress.ip_interface(a).version == 6 and not a.startswith("fe80")]
    assert len(v4) == 1 and ipaddress.ip_interface(v4[0]) in ipaddress.ip_network(SUBNET4)
    assert len(v6) == 1 and ipaddress.ip_interface(v6[0]).ip in ipaddress.ip_network(SUBNET6)
    assert "tentative" not in out, out
    gw4, gw6 = ("169.254.1.1", "fe80::1") if podman.datapath == "routed" else (GW4, GW6)
    assert f"default via {gw4} dev eth0" in out and f"default via {gw6} dev eth0" in out
    assert out.count("1 packets received") == 2, out
    assert podman.leases() == []  # --rm: DEL ran and freed both addresses


def test_removing_the_container_frees_the_lease(podman: Podman) -> None:
    cid = podman.run(
        "run", "-d", "--network", NETWORK, "--rootfs", str(podman.rootfs), "/bin/sleep", "300"
    ).strip()  # fmt: skip
    leased = podman.leases()
    assert len(leased) == 2, leased
    inside = podman.run("exec", cid, "/bin/ip", "-o", "addr", "show", "dev", "eth0")
    for ip in leased:
        assert f" {ip}/" in inside
    ports = json.loads(
        subprocess.run(["ip", "-n", podman.host_netns, "-j", "link", "show", "master", BRIDGE],
                       capture_output=True, text=True, check=True).stdout
    )  # fmt: skip
    assert len(ports) == 1 and ports[0]["ifname"].startswith("veth")
    podman.run("rm", "-f", "-t", "0", cid)
    assert podman.leases() == []
    ports_after = subprocess.run(
        ["ip", "-n", podman.host_netns, "-j", "link", "show", "master", BRIDGE], capture_output=True, text=True
    ).stdout
    assert json.loads(ports_after or "[]") == []


@pytest.fixture
def agent(podman: Podman) -> Iterator[Path]:
    """``nodeplug agent`` with only the CNI plugin, in the podman host netns; yields its log file."""
    nodeplug = REPO / ".venv" / "bin" / "nodeplug"
    if not nodeplug.exists():
        pytest.skip(f"the agent CLI is not installed in the venv ({nodeplug}): run scripts/setup")
    config = podman.tmp / "agent.yaml"
    config.write_text(
        "http: {address: '127.0.0.1:0'}\ndeviceplugin: {enabled: false}\ncsi: {enabled: false}\ncni: {enabled: true}\n"
    )
    log_path = podman.tmp / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{podman.host_netns}", str(nodeplug), "agent", "--config", str(config),
             "--root", str(podman.agent_root)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_for("the agent's socket", lambda: running(proc, log_path) and podman.agent_socket.exists(), 60)
            yield log_path
        finally:
            stop(proc, 15)


def test_thick_mode_the_agent_does_the_work(podman: Podman, agent: Path) -> None:
    cid = podman.run(
        "run", "-d", "--network", NETWORK, "--rootfs", str(podman.rootfs), "/bin/sleep", "300"
    ).strip()  # fmt: skip
    assert len(podman.leases()) == 2
    out = podman.run("exec", cid, "/bin/sh", "-c", f"ping -c 1 -W 2 {GW4} && ping -c 1 -W 2 {GW6}")
    assert out.count("1 packets received") == 2, out
    podman.run("rm", "-f", "-t", "0", cid)
    assert podman.leases() == []
    served = [line for line in agent.read_text().splitlines() if "CNI request done" in line and cid in line]
    assert any("command=ADD" in line for line in served), agent.read_text()[-2000:]
    assert any("command=DEL" in line for line in served), agent.read_text()[-2000:]
