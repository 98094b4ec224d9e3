"""The ``nodeplug`` entry point exec'd as a runtime does, against the whole agent (thick mode) and without it.

The agent (``nodeplug agent`` with only the cni plugin enabled) and every entry-point run live in a test "host" netns
through ``ip netns exec``, so the bridge they make is removed with it; pods are further netns.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cni.policy import quarantine

from lab.cniexec import exec_plugin
from support.agent import free_port
from support.wait import running, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates netns and links")]

ENTRY = str(Path(sys.executable).parent / "nodeplug-cni")


class Agent:
    def __init__(self, host: str, tmp: Path) -> None:
        self.host, self.tmp = host, tmp
        self.root = tmp / "root"
        self.root.mkdir(exist_ok=True)
        self.sock = self.root / "run/nodeplug/cni.sock"
        self.log = tmp / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def agent_argv(self) -> list[str]:
        return ["ip", "netns", "exec", self.host, sys.executable, "-m", "nodeplug.cli", "agent"]

    def start(self, cni: str = "") -> None:
        """``cni``: more lines of the config's cni section (indented by two spaces)."""
        cfg = self.tmp / "agent.yaml"
        cfg.write_text(
            f"http:\n  address: 127.0.0.1:{free_port()}\nshutdown_grace_seconds: 2\n"
            f"deviceplugin:\n  enabled: false\ncsi:\n  enabled: false\ncni:\n  workers: 4\n{cni}"
        )
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*self.agent_argv, "--config", str(cfg), "--root", str(self.root)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for(f"{self.sock}", lambda: running(self.proc, self.log) and self.sock.is_socket(), timeout=60)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    def served(self, container_id: str) -> bool:
        return f"container_id={container_id}" in self.log.read_text()


@pytest.fixture
def host(netns: Callable[[], str]) -> str:
    return netns()


@pytest.fixture
def agent(host: str, tmp_path: Path) -> Iterator[Agent]:
    a = Agent(host, tmp_path)
    try:
        yield a
    finally:
        a.stop(signal.SIGKILL)


def netconf(tmp: Path, sock: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.1.0",
        "name": "e2enet",
        "type": "nodeplug",
        "bridge": "npe2e0",
        "isDefaultGateway": True,
        "socket": str(sock),
        "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.94.0.0/24"}]], "dataDir": str(tmp / "ipam")},
    }


def run(host: str, command: str, conf: dict[str, Any], cid: str, netns: str = "", pre: tuple[str, ...] = ()) -> Any:
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": command, "CNI_CONTAINERID": cid, "CNI_IFNAME": "eth0"}
    env["CNI_PATH"] = "/usr/lib/cni"
    if netns:
        env["CNI_NETNS"] = netns
    return exec_plugin(["ip", "netns", "exec", host, *pre, ENTRY], conf, env)


def leases(tmp: Path) -> list[tuple[str, str]]:
    db = tmp / "ipam" / "e2enet.db"
    if not db.exists():
        return []
    with sqlite3.connect(db) as c:
        return sorted(c.execute("SELECT container_id, ip FROM leases").fetchall())


@pytest.fixture
def served(agent: Agent, netns: Callable[[], str], tmp_path: Path) -> tuple[dict[str, Any], str]:
    """The agent started; a network config naming its socket, and a pod's network namespace (path)."""
    agent.start()
    return netconf(tmp_path, agent.sock), f"/run/netns/{netns()}"


@pytest.mark.parametrize("datapath", ["bridge", "routed"])
def test_thick_mode_add_check_del_through_the_agent(
    sh: Callable[..., str], agent: Agent, host: str, served: tuple[dict[str, Any], str], tmp_path: Path, datapath: str
) -> None:
    conf, pod = served
    conf["datapath"] = datapath
    code, res, err = run(host, "ADD", conf, "thick1", pod)
    assert code == 0, (res, err)
    if datapath == "routed":
        assert res["ips"] == [{"address": "10.94.0.2/32", "gateway": "169.254.1.1", "interface": 1}]
        sh("ip", "-n", host, "addr", "add", "10.94.0.1/32", "dev", "lo")  # an address of the node, to ping
    else:
        assert res["ips"] == [{"address": "10.94.0.2/24", "gateway": "10.94.0.1", "interface": 2}]
    assert agent.served("thick1")
    sh("ip", "netns", "exec", os.path.basename(pod), "ping", "-c", "1", "-W", "2", "10.94.0.1")
    assert run(host, "CHECK", {**conf, "prevResult": res}, "thick1", pod)[:2] == (0, None)
    assert run(host, "STATUS", conf, "")[:2] == (0, None)
    assert run(host, "DEL", {**conf, "prevResult": res}, "thick1", pod)[:2] == (0, None)
    assert leases(tmp_path) == []
    # a malformed request is answered by the agent with the spec's error JSON
    code, res, _ = run(host, "ADD", {**conf, "mtu": "abc"}, "thick2", pod)
    assert code == 1 and res["code"] == 7 and res["details"].startswith("mtu:")


def test_thick_mode_add_imports_no_netlink_in_the_entry_point(
    agent: Agent, host: str, netns: Callable[[], str], tmp_path: Path
) -> None:
    agent.start()
    pod = f"/run/netns/{netns()}"
    code, res, err = run(
        host, "ADD", netconf(tmp_path, agent.sock), "imp1", pod, pre=(sys.executable, "-X", "importtime")
    )
    assert code == 0, res
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "cni.thick" in imported
    assert not {"pyroute2", "grpc", "pydantic", "cni.dataplane", "cni.commands"} & imported


@pytest.mark.parametrize("datapath", ["bridge", "routed"])
def test_del_after_the_agent_died_falls_back_and_frees_the_lease(
    sh: Callable[..., str], agent: Agent, host: str, served: tuple[dict[str, Any], str], tmp_path: Path, datapath: str
) -> None:
    conf, pod = served
    conf["datapath"] = datapath
    code, res, _ = run(host, "ADD", conf, "orphan", pod)
    assert code == 0 and leases(tmp_path) == [("orphan", "10.94.0.2")]
    agent.stop(signal.SIGKILL)  # the socket file stays behind, nobody listens
    assert agent.sock.exists()
    code, out, err = run(host, "DEL", conf, "orphan", pod)  # no prevResult either
    assert (code, out) == (0, None), err
    assert leases(tmp_path) == []
    assert res["interfaces"][-2]["name"] not in sh("ip", "-n", host, "-o", "link", "show")


@pytest.mark.parametrize("datapath", ["bridge", "routed"])
def test_thick_del_frees_everything_before_it_answers_even_with_the_agent_killed_right_after(
    sh: Callable[..., str], agent: Agent, host: str, served: tuple[dict[str, Any], str], tmp_path: Path, datapath: str
) -> None:
    """The agent answers DEL before the kernel has finished freeing the veth pair: by then the lease is released,
    both ends and their routes are gone, and an ADD of the same container into the same netns works at once; a
    kill -9 of the agent right after the answer leaves nothing behind."""
    conf, pod = served
    conf["datapath"] = datapath

    def host_veths() -> list[str]:
        return [line.split(":")[1].strip().split("@")[0] for line in sh("ip", "-n", host, "-o", "link").splitlines()
                if line.split(":")[1].strip().startswith("veth")]  # fmt: skip

    for _ in range(3):
        code, res, err = run(host, "ADD", conf, "again", pod)
        assert code == 0, (res, err)
        assert run(host, "DEL", conf, "again", pod)[:2] == (0, None)
        assert leases(tmp_path) == [] and host_veths() == []
        assert "eth0" not in sh("ip", "-n", os.path.basename(pod), "-o", "link")
        assert sh("ip", "-n", host, "route", "show", "10.94.0.2") == ""
    assert agent.served("again")
    code, res, _ = run(host, "ADD", conf, "killed", pod)
    assert code == 0, res
    assert run(host, "DEL", conf, "killed", pod)[:2] == (0, None)
    agent.stop(signal.SIGKILL)
    assert leases(tmp_path) == [] and host_veths() == []
    code, res, err = run(host, "ADD", conf, "killed", pod)  # standalone now: nothing of the old pair is in the way
    assert code == 0, (res, err)
    assert run(host, "DEL", conf, "killed", pod)[:2] == (0, None)
    assert leases(tmp_path) == [] and host_veths() == []


def test_an_oversized_request_for_another_socket_is_not_refused_by_the_launchers_agent(
    agent: Agent, host: str, netns: Callable[[], str], tmp_path: Path, cni_bundle: Path
) -> None:
    """Regression (issue 18, item 6), through the bundle's launcher: the agent at the launcher's socket refuses a
    request larger than its max_request_bytes before reading which socket it names. That refusal is the answer only
    when the config names that agent; a config naming another socket (here nobody's) is served standalone."""
    agent.start("  max_request_bytes: 4096\n")
    pod = f"/run/netns/{netns()}"
    padding = {"padding": "x" * 6000}  # an unknown key: ignored by the plugin, counted by the agent's limit
    other = {**netconf(tmp_path, tmp_path / "absent.sock"), **padding}
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": "ADD", "CNI_CONTAINERID": "big", "CNI_IFNAME": "eth0",
           "CNI_NETNS": pod, "CNI_PATH": "/usr/lib/cni", "NODEPLUG_CNI_SOCKET": str(agent.sock)}  # fmt: skip
    launcher = ["ip", "netns", "exec", host, str(cni_bundle / "nodeplug")]
    code, res, err = exec_plugin(launcher, other, env)
    assert code == 0 and res["ips"][0]["address"].startswith("10.94.0."), (res, err)
    assert "CNI request refused" in agent.log.read_text() and not agent.served("big")
    mine = {**netconf(tmp_path, agent.sock), **padding}
    code, res, _ = exec_plugin(launcher, mine, {**env, "CNI_CONTAINERID": "big2"})
    assert code == 1 and res["code"] == 7 and "(4096 bytes: cni.max_request_bytes" in res["details"]
    assert exec_plugin(launcher, other, {**env, "CNI_COMMAND": "DEL"})[0] == 0
    assert leases(tmp_path) == []


def test_standalone_add_then_thick_del_share_the_store(
    agent: Agent, host: str, netns: Callable[[], str], tmp_path: Path
) -> None:
    conf = netconf(tmp_path, agent.sock)
    pods = [f"/run/netns/{netns()}" for _ in range(2)]
    code, first, _ = run(host, "ADD", conf, "s1", pods[0])  # no agent yet: standalone
    assert code == 0
    agent.start()
    code, second, _ = run(host, "ADD", conf, "s2", pods[1])
    assert code == 0 and agent.served("s2") and not agent.served("s1")
    assert first["ips"][0]["address"] != second["ips"][0]["address"]
    for cid, pod in (("s1", pods[0]), ("s2", pods[1])):
        assert run(host, "DEL", conf, cid, pod)[:2] == (0, None)
    assert leases(tmp_path) == []


def test_version_without_agent_and_without_stdin(host: str) -> None:
    p = subprocess.run([ENTRY], input=b"", capture_output=True, env={"CNI_COMMAND": "VERSION"}, timeout=30, check=False)
    assert p.returncode == 0
    assert json.loads(p.stdout)["supportedVersions"] == ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
    p = subprocess.run([ENTRY], input=b"{}", capture_output=True, env={}, timeout=30, check=False)
    assert p.returncode == 1 and json.loads(p.stdout)["code"] == 4


@pytest.mark.skipif(not shutil.which("nft"), reason="no nft: needed to make the quarantine table")
def test_a_standalone_add_and_del_of_a_pod_hold_its_address_in_quarantine_without_running_nft(
    host: str, netns: Callable[[], str], tmp_path: Path
) -> None:
    """The entry point (no agent) quarantines a Kubernetes pod's address at ADD and again at DEL, by talking to the
    kernel itself: nothing that would run ``nft`` (subprocess, the agent's command runner, asyncio) is imported."""
    subprocess.run(["ip", "netns", "exec", host, "nft", "-f", "-"], input=quarantine.SETUP, text=True, check=True)
    conf = netconf(tmp_path, tmp_path / "no-agent.sock")
    env = {"PATH": os.environ["PATH"], "CNI_CONTAINERID": "q1", "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni",
           "CNI_NETNS": f"/run/netns/{netns()}", "CNI_ARGS": "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p1"}  # fmt: skip
    argv = ["ip", "netns", "exec", host, sys.executable, "-X", "importtime", ENTRY]

    def held() -> set[str]:
        out = subprocess.run(["ip", "netns", "exec", host, "nft", "-j", "list", "set", "inet", quarantine.TABLE, "q4"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return {e for item in json.loads(out)["nftables"] for e in (item.get("set") or {}).get("elem", [])}

    for command in ("ADD", "DEL"):
        code, res, err = exec_plugin(argv, conf, {**env, "CNI_COMMAND": command})
        assert code == 0, (res, err)
        imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
        assert "cni.policy.nfsets" in imported
        assert not {"subprocess", "asyncio", "nodeplug.commands", "pyroute2"} & imported, command
        assert held() == {"10.94.0.2"}, command
    assert leases(tmp_path) == []
