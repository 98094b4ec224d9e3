"""One node of the DaemonSet, emulated: the init container's ``install-cni`` and the agent container's ``nodeplug
agent`` with the shipped config, both as daemonset/ starts them but under a temporary root, in a test netns that
stands in for the node. The runtime's ADD and DEL go through the installed bundle: first with no agent (the bundle
does the work, masquerade rules with nft included), then with the agent serving the CNI socket (thick mode).

Test-only changes to the shipped command lines: ``--root``, the bundle path, the socket and IPAM directory under that
root (absolute host paths in the conflist), and the agent's HTTP address on loopback with a free port.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cni import thick
from cni.nodesubnets import NodeSubnets

from lab.cniexec import exec_plugin
from support.processes import stop
from support.wait import running, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces, bridges, nft"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft is not installed (Debian package nftables)"),
]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle(cni_bundle: Path) -> Path:
    return cni_bundle


def pod_spec() -> dict[str, Any]:
    ds = yaml.safe_load((REPO / "daemonset/daemonset.yaml").read_text())
    spec: dict[str, Any] = ds["spec"]["template"]["spec"]
    return spec


def command_of(name: str) -> list[str]:
    spec = pod_spec()
    c = next(c for c in spec["initContainers"] + spec["containers"] if c["name"] == name)
    argv: list[str] = [*c.get("command", []), *c.get("args", [])]
    assert argv[0] == "nodeplug"
    return argv[1:]


class Node:
    def __init__(self, root: Path, hostns: str) -> None:
        self.root, self.hostns = root, hostns
        self.socket = root / "run/nodeplug/cni.sock"
        self.ipam = root / "var/lib/nodeplug/ipam"
        self.subnets = root / "var/lib/nodeplug/cluster/subnets.json"

    def nsenter(self, *argv: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.hostns}", *argv]

    def cni(self, command: str, conf: dict[str, Any], **env: str) -> tuple[int, dict[str, Any]]:
        # no $NODEPLUG_CNI_SOCKET (no runtime sets it): the launcher asks the agent install-cni recorded for the
        # conflist, this node's (under its root), not the machine's default (a real agent may serve that one)
        full = {"CNI_COMMAND": command, "CNI_PATH": str(self.root / "opt/cni/bin"), "PATH": os.environ["PATH"], **env}
        code, out, _ = exec_plugin(self.nsenter(str(self.root / "opt/cni/bin/nodeplug")), conf, full)
        return code, out or {}

    def network(self) -> dict[str, Any]:
        conflist = json.loads((self.root / "etc/cni/net.d/10-nodeplug.conflist").read_text())
        (plugin,) = conflist["plugins"]
        return {"cniVersion": conflist["cniVersion"], "name": conflist["name"], **plugin}

    def ruleset(self) -> str:
        return subprocess.run(self.nsenter("nft", "list", "ruleset"), capture_output=True, text=True, check=True,
                              timeout=10).stdout  # fmt: skip


@pytest.fixture
def node(tmp_path: Path, netns: Callable[[], str], bundle: Path) -> Node:
    """install-cni as the init container runs it, under a temporary root."""
    n = Node(tmp_path / "node", netns())
    args = command_of("install-cni")
    args = [a for a in args if not a.startswith("--bundle=")]
    argv = [*args, "--root", str(n.root), "--bundle", str(bundle), "--socket", str(n.socket),
            "--ipam-data-dir", str(n.ipam), "--node-subnets", str(n.subnets),
            "--config", str(REPO / "daemonset/agent.yaml")]  # the ConfigMap the init container mounts  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "nodeplug.cli", *argv], capture_output=True, text=True, timeout=120,
                       check=False, cwd=REPO)  # fmt: skip
    assert p.returncode == 0, p.stderr
    # this node's podCIDRs, as the agent keeps them once it has seen its Node (the cluster network)
    n.subnets.parent.mkdir(parents=True)
    n.subnets.write_bytes(NodeSubnets("node-a", ("10.94.0.0/24", "fd94::/64"), 1450).dumps())
    return n


@pytest.fixture
def agent(node: Node, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The agent container's command with the shipped config (HTTP on loopback, a free port), in the node's netns."""
    cfg = yaml.safe_load((REPO / "daemonset/agent.yaml").read_text())
    cfg["http"]["address"] = "127.0.0.1:0"
    cfg["csi"]["reserved_bytes"] = 0
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(cfg))
    args = [a for a in command_of("agent") if not a.startswith("--config=")]
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            node.nsenter(sys.executable, "-m", "nodeplug.cli", *args, "--config", str(config),
                         "--root", str(node.root)),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
        try:
            wait_for("the agent's CNI socket", lambda: running(proc, log_path) and node.socket.exists(), timeout=60)
            yield log_path, proc.pid
        finally:
            stop(proc, 30)


def test_standalone_then_thick_through_the_installed_bundle(
    node: Node, netns: Callable[[], str], request: pytest.FixtureRequest
) -> None:
    podns = netns()
    conf = node.network()
    # the cluster network: no per-pod masquerade (the agent masquerades what leaves the cluster CIDRs)
    assert conf["ipMasq"] is False and conf["socket"] == str(node.socket)
    assert conf["datapath"] == "routed"  # the shipped agent config's cni.datapath
    record = node.root / "opt/cni/bin/nodeplug.d" / thick.SOCKET_RECORD
    assert record.read_text() == f"{node.socket}\n"  # the conflist's socket, for the launcher (which reads no JSON)
    assert conf["ipam"]["nodeSubnets"] == str(node.subnets)
    if Path("/usr/lib/cni/loopback").exists():  # the image's reference plugins, put where the host has none
        assert (node.root / "opt/cni/bin/loopback").is_file() and (node.root / "opt/cni/bin/portmap").is_file()
    env = {"CNI_CONTAINERID": "ds-standalone", "CNI_NETNS": f"/run/netns/{podns}", "CNI_IFNAME": "eth0"}

    # No agent yet (the DaemonSet's pod is starting): the bundle does the work itself, in this node's podCIDRs.
    code, result = node.cni("ADD", conf, **env)
    assert code == 0, result
    assert [ip["address"] for ip in result["ips"]] == ["10.94.0.2/32", "fd94::2/128"]
    link = json.loads(subprocess.run(["ip", "-n", podns, "-j", "link", "show", "eth0"], capture_output=True,
                                     text=True, check=True, timeout=10).stdout)[0]  # fmt: skip
    assert link["mtu"] == 1450
    assert "masquerade" not in node.ruleset()
    code, out = node.cni("DEL", {**conf, "prevResult": result}, **env)
    assert code == 0, out

    # The agent container is up: the same calls are served by it.
    log_path, _ = request.getfixturevalue("agent")
    env2 = {**env, "CNI_CONTAINERID": "ds-thick"}
    code, result = node.cni("ADD", conf, **env2)
    assert code == 0, result
    shown = subprocess.run(["ip", "-n", podns, "-j", "addr", "show", "eth0"], capture_output=True, text=True,
                           check=True, timeout=10).stdout  # fmt: skip
    assert result["ips"][0]["address"].split("/")[0] in shown
    code, out = node.cni("DEL", {**conf, "prevResult": result}, **env2)
    assert code == 0, out
    served = [ln for ln in log_path.read_text().splitlines() if "CNI request done" in ln and "ds-thick" in ln]
    assert any("command=ADD" in ln for ln in served), log_path.read_text()[-3000:]
    assert any("command=DEL" in ln for ln in served), log_path.read_text()[-3000:]
    assert not [ln for ln in log_path.read_text().splitlines() if "ds-standalone" in ln]


def test_the_shipped_agent_config_serves_health(node: Node, agent: tuple[Path, int]) -> None:
    log_path, _ = agent
    text = log_path.read_text()
    addr = next((ln for ln in text.splitlines() if "serving health and metrics" in ln), None)
    assert addr is not None, text[-3000:]
    port = int(addr.split("address=")[1].split()[0].rsplit(":", 1)[1].strip('"'))
    fetch = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).status)"
    p = subprocess.run(node.nsenter(sys.executable, "-c", fetch, f"http://127.0.0.1:{port}/healthz"),
                       capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert p.stdout.strip() == "200", p.stderr
    text = log_path.read_text()
    for plugin in ("deviceplugin", "csi", "cni"):
        assert f'msg="starting plugin" name={plugin}' in text, text[-3000:]
    assert "level=error" not in text, text[-3000:]
