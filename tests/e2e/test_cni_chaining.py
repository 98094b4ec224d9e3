"""nodeplug in a conflist with the reference portmap, tuning and bandwidth after it (on both datapaths), and as the
reference bridge's IPAM.

The test plays the runtime: it execs each plugin of the list in order for ADD and CHECK (each gets its own config
with name, cniVersion and the previous plugin's result as prevResult injected, plus runtimeConfig for the
capabilities it declares) and in reverse order for DEL, as libcni does. Everything runs inside a test "host" netns
(``ip netns exec``), so bridges, iptables rules and ifb devices live and die with it. cniVersion 1.0.0: the Debian
reference plugins speak CNI up to 1.0.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lab.cniexec import exec_plugin

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates netns and links")]

REF = "/usr/lib/cni"


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A CNI_PATH directory holding our entry point as ``nodeplug``."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "nodeplug").symlink_to(Path(sys.executable).parent / "nodeplug-cni")
    return d


class Runtime:
    def __init__(self, host: str, cni_path: str) -> None:
        self.host, self.cni_path = host, cni_path

    def exec(self, plugin: str, command: str, conf: dict[str, Any], cid: str, netns: str, args: str = "") -> Any:
        exe = next(Path(d) / plugin for d in self.cni_path.split(":") if (Path(d) / plugin).exists())
        env = {
            "PATH": os.environ["PATH"],
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": netns,
            "CNI_IFNAME": "eth0",
            "CNI_PATH": self.cni_path,
            "CNI_ARGS": args,
        }
        code, out, err = exec_plugin(["ip", "netns", "exec", self.host, str(exe)], conf, env)
        if code != 0:
            raise AssertionError(f"{plugin} {command} failed ({code}): {out} {err}")
        return out

    def _plugin_conf(self, netlist: dict[str, Any], plugin: dict[str, Any], rc: dict[str, Any], prev: Any) -> Any:
        conf = {**plugin, "name": netlist["name"], "cniVersion": netlist["cniVersion"]}
        caps = plugin.get("capabilities", {})
        wanted = {k: v for k, v in rc.items() if caps.get(k)}
        if wanted:
            conf["runtimeConfig"] = wanted
        if prev is not None:
            conf["prevResult"] = prev
        return conf

    def add(self, netlist: dict[str, Any], cid: str, netns: str, rc: dict[str, Any]) -> Any:
        prev = None
        for plugin in netlist["plugins"]:
            prev = self.exec(plugin["type"], "ADD", self._plugin_conf(netlist, plugin, rc, prev), cid, netns)
        return prev

    def check(
        self, netlist: dict[str, Any], cid: str, netns: str, rc: dict[str, Any], result: Any, skip: tuple[str, ...] = ()
    ) -> None:
        for plugin in netlist["plugins"]:
            if plugin["type"] in skip:
                continue
            self.exec(plugin["type"], "CHECK", self._plugin_conf(netlist, plugin, rc, result), cid, netns)

    def delete(self, netlist: dict[str, Any], cid: str, netns: str, rc: dict[str, Any], result: Any) -> None:
        for plugin in reversed(netlist["plugins"]):
            self.exec(plugin["type"], "DEL", self._plugin_conf(netlist, plugin, rc, result), cid, netns)


@pytest.fixture
def runtime(netns: Callable[[], str], bin_dir: Path) -> Runtime:
    return Runtime(netns(), f"{bin_dir}:{REF}")


def leases(data_dir: Path, network: str) -> list[tuple[str, str]]:
    import sqlite3

    db = data_dir / f"{network}.db"
    if not db.exists():
        return []
    with sqlite3.connect(db) as c:
        return sorted(c.execute("SELECT container_id, ip FROM leases").fetchall())


HOST_ADDR = "10.94.0.1"  # an address of the test host (on its loopback): where the pod's hostPort is reached


def serve_once(sh: Callable[..., str], pod: str, port: int) -> subprocess.Popen[str]:
    """A TCP server in ``pod`` answering one connection with "pong"; wait for its first line (listening)."""
    code = (
        "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('0.0.0.0', {port})); s.listen(1); print('listening', flush=True)\n"
        "s.settimeout(30); c, _ = s.accept(); c.sendall(b'pong'); c.close()\n"
    )
    proc = subprocess.Popen(["ip", "netns", "exec", pod, sys.executable, "-c", code], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


@pytest.mark.parametrize("datapath", ["bridge", "routed"])
def test_conflist_with_portmap_tuning_bandwidth(
    sh: Callable[..., str], runtime: Runtime, netns: Callable[[], str], tmp_path: Path, datapath: str
) -> None:
    netlist = {
        "cniVersion": "1.0.0",
        "name": "chainnet",
        "plugins": [
            {
                "type": "nodeplug",
                "bridge": "npchain0",
                "datapath": datapath,
                "isDefaultGateway": True,
                "socket": str(tmp_path / "no-agent.sock"),
                "ipam": {
                    "type": "nodeplug",
                    "ranges": [[{"subnet": "10.92.0.0/24"}], [{"subnet": "fd92::/64"}]],
                    "dataDir": str(tmp_path / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
            {"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.accept_redirects": "0"}, "mtu": 1400},
            {"type": "bandwidth", "capabilities": {"bandwidth": True}},
        ],
    }
    rc = {
        "portMappings": [{"hostPort": 18080, "containerPort": 80, "protocol": "tcp"}],
        "bandwidth": {
            "ingressRate": 8_000_000,
            "ingressBurst": 1_000_000,
            "egressRate": 8_000_000,
            "egressBurst": 1_000_000,
        },
    }
    pod = f"/run/netns/{netns()}"
    pod_name = os.path.basename(pod)
    result = runtime.add(netlist, "chain1", pod, rc)
    # our result flowed through all three, dual stack
    assert result["cniVersion"] == "1.0.0"
    routed = datapath == "routed"
    want = ["10.92.0.2/32", "fd92::2/128"] if routed else ["10.92.0.2/24", "fd92::2/64"]
    assert [ip["address"] for ip in result["ips"]] == want
    names = [i["name"] for i in result["interfaces"]]
    names = names[: names.index("eth0") + 1]  # bandwidth adds its ifb device after them
    host_veth = names[-2]
    assert names == ([] if routed else ["npchain0"]) + [host_veth, "eth0"] and host_veth.startswith("veth")
    assert leases(tmp_path / "ipam", "chainnet") == [("chain1", "10.92.0.2"), ("chain1", "fd92::2")]
    # tuning applied in the pod, portmap's DNAT in the host netns, bandwidth's qdisc on the host veth
    link = json.loads(sh("ip", "-n", pod_name, "-j", "link", "show", "eth0"))[0]
    assert link["mtu"] == 1400
    assert sh("ip", "netns", "exec", pod_name, "sysctl", "-n", "net.ipv4.conf.eth0.accept_redirects").strip() == "0"
    nat = sh("ip", "netns", "exec", runtime.host, "iptables-save", "-t", "nat")
    assert "18080" in nat and "10.92.0.2:80" in nat
    qdiscs = sh("ip", "netns", "exec", runtime.host, "tc", "qdisc", "show", "dev", host_veth)
    assert "tbf" in qdiscs or "ingress" in qdiscs
    # the node (an address of its own) reaches the pod's port 80 at its hostPort, and the pod reaches the node
    sh("ip", "-n", runtime.host, "addr", "add", f"{HOST_ADDR}/32", "dev", "lo")
    server = serve_once(sh, pod_name, 80)
    try:
        connect = f"import socket; print(socket.create_connection(('{HOST_ADDR}', 18080), timeout=5).recv(9).decode())"
        got = sh("ip", "netns", "exec", runtime.host, sys.executable, "-c", connect)
        assert got.strip() == "pong"
    finally:
        server.kill()
        server.communicate()
    sh("ip", "netns", "exec", pod_name, "ping", "-c", "1", "-W", "2", "10.92.0.1" if not routed else HOST_ADDR)

    # The Debian portmap (1.1.1) fails its own CHECK whatever the chain holds: it looks for its IPv4 rules in the
    # IPv6 table ("could not check ipv6 dnat"). Every other plugin of the list is checked.
    runtime.check(netlist, "chain1", pod, rc, result, skip=("portmap",))
    runtime.delete(netlist, "chain1", pod, rc, result)
    assert leases(tmp_path / "ipam", "chainnet") == []
    assert "18080" not in sh("ip", "netns", "exec", runtime.host, "iptables-save", "-t", "nat")
    assert host_veth not in sh("ip", "-n", runtime.host, "-o", "link", "show")


def test_reference_bridge_delegates_ipam_to_nodeplug(
    sh: Callable[..., str], runtime: Runtime, netns: Callable[[], str], tmp_path: Path
) -> None:
    netlist = {
        "cniVersion": "1.0.0",
        "name": "refnet",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "nprefbr0",
                "isGateway": True,
                "ipam": {
                    "type": "nodeplug",
                    "ranges": [[{"subnet": "10.93.0.0/24"}], [{"subnet": "fd93::/64"}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(tmp_path / "ipam"),
                    "socket": str(tmp_path / "no-agent.sock"),  # not the default: an agent may serve that one
                },
            }
        ],
    }
    pod = f"/run/netns/{netns()}"
    result = runtime.add(netlist, "ref1", pod, {})
    assert [ip["address"] for ip in result["ips"]] == ["10.93.0.2/24", "fd93::2/64"]
    assert leases(tmp_path / "ipam", "refnet") == [("ref1", "10.93.0.2"), ("ref1", "fd93::2")]
    sh("ip", "netns", "exec", os.path.basename(pod), "ping", "-c", "1", "-W", "2", "10.93.0.1")
    runtime.check(netlist, "ref1", pod, {}, result)
    runtime.delete(netlist, "ref1", pod, {}, result)
    assert leases(tmp_path / "ipam", "refnet") == []
