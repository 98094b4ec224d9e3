"""``cni.doctor`` checks against the whole agent (in a test host netns) and without it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cni.config import Config
from cni.doctor import checks
from nodeplug.checks import CheckSkipped
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

from support.wait import running, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates netns and links")]

_RUN = """
import asyncio, json, sys
from pathlib import Path
from cni.config import Config
from cni.doctor import checks
from nodeplug.checks import CheckSkipped
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext


async def main():
    out = {}
    ctx = AgentContext(root=Root(Path(sys.argv[1])))
    for c in [c for c in checks(Config(doctor_bridge="npdoc0", datapath=sys.argv[2]), ctx) if c.group == "cni"]:
        try:
            out[c.name] = ["ok", await c.run()]
        except CheckSkipped as e:
            out[c.name] = ["skip", str(e)]
        except Exception as e:
            out[c.name] = ["fail", str(e)]
    print(json.dumps(out))

asyncio.run(main())
"""


def agent_in(host: str) -> list[str]:
    return ["ip", "netns", "exec", host, sys.executable, "-m", "nodeplug.cli", "agent"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_doctor_without_agent_skips(tmp_root: Path) -> None:
    async def run_all() -> list[str]:
        got = []
        for c in [c for c in checks(Config(), AgentContext(root=Root(tmp_root))) if c.group == "cni"]:
            with pytest.raises(CheckSkipped) as e:
                await c.run()
            got.append(str(e.value))
        return got

    got = asyncio.run(run_all())
    assert "not installed" in got[0] and all("not serving" in g for g in got[1:])


@pytest.mark.parametrize("datapath", ["bridge", "routed"])
def test_doctor_with_agent_attaches_pings_and_frees(netns: Callable[[], str], tmp_path: Path, datapath: str) -> None:
    host = netns()
    root = tmp_path / "root"
    root.mkdir()
    bin_dir = root / "opt/cni/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nodeplug").symlink_to(Path(sys.executable).parent / "nodeplug-cni")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        f"http:\n  address: 127.0.0.1:{free_port()}\ndeviceplugin:\n  enabled: false\ncsi:\n  enabled: false\n"
        "cni:\n  doctor_bridge: npdoc0\n"
    )
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            [*agent_in(host), "--config", str(cfg), "--root", str(root)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        sock = root / "run/nodeplug/cni.sock"
        wait_for("the agent's CNI socket", lambda: running(agent, log) and sock.is_socket(), timeout=60)
        # the doctor runs in the root netns: a netns it adds from inside `ip netns exec` (a private mount namespace)
        # would not be visible to the agent
        p = subprocess.run(
            [sys.executable, "-c", _RUN, str(root), datapath],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    entry, status, attach = got.values()
    assert entry[0] == "ok" and "1.1.0" in entry[1]
    assert status == ["ok", "the agent can service ADD"]
    assert attach[0] == "ok", attach
    assert attach[1].startswith(f"{datapath}: ADD ") and "lease freed" in attach[1]
    assert ("ping another pod" in attach[1]) == (datapath == "routed")
    assert not [n for n in os.listdir("/run/netns") if n.startswith("npdoctor-")]
