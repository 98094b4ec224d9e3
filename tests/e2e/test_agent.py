"""The whole agent as a process: defaults under --root, health endpoints, reload, graceful stop."""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from support.agent import AgentProcess
from support.wait import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent's plugins create loop devices and bridges"),
]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def agent(spawn_agent: Callable[..., AgentProcess]) -> AgentProcess:
    running = spawn_agent()
    running.wait_healthy()
    return running


def sockets_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_socket())


def test_defaults_serve_every_plugin_and_stop_cleanly(agent: AgentProcess) -> None:
    root = agent.root
    expected = [
        root / "var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock",
        root / "var/lib/kubelet/plugins_registry/local.csi.nodeplug.io-reg.sock",
        root / "run/nodeplug/cni.sock",
        root / "var/lib/kubelet/device-plugins/nodeplug-fuse.sock",
    ]
    with contextlib.suppress(AssertionError):  # which one is missing is said below
        wait_for("every socket", lambda: all(p.exists() for p in expected), timeout=60)
    for p in expected:
        assert p.is_socket(), f"{p} missing; sockets: {sockets_under(root)}\n{agent.log.read_text()}"
        assert (p.stat().st_mode & 0o777) == 0o600, p

    # every plugin has a line from its start on ("starting" until its start returns); csi and cni become ready
    wait_for("csi and cni ready", lambda: all(f"{p}: ready" in get(agent.url("/readyz"))[1] for p in ("csi", "cni")),
             timeout=60)  # fmt: skip
    status, body = get(agent.url("/readyz"))
    assert "csi:" in body and "cni:" in body and "deviceplugin:" in body
    # no kubelet here: the device plugin cannot register, so the agent is alive but not ready
    assert status == 503 and "deviceplugin: not ready" in body

    status, metrics = get(agent.url("/metrics"))
    assert status == 200 and "nodeplug_rpc_duration_seconds" in metrics
    # the same verdicts, per plugin, for alerts (daemonset/monitoring/)
    ready = {line.split('"')[1]: line.rsplit(" ", 1)[1] for line in metrics.splitlines()
             if line.startswith("nodeplug_plugin_ready{")}  # fmt: skip
    assert ready == {"csi": "1.0", "cni": "1.0", "deviceplugin": "0.0"}, ready
    assert get(agent.url("/nope"))[0] == 404

    assert agent.stop() == 0
    assert sockets_under(root) == [], agent.log.read_text()
    log = agent.log.read_text()
    assert "level=error" not in log, log


def test_bad_reload_keeps_the_running_config(agent: AgentProcess) -> None:
    cfg = agent.config
    good = cfg.read_text()
    cfg.write_text(good + "csi:\n  enabled: maybe\n")
    agent.proc.send_signal(signal.SIGHUP)
    wait_for("the reload refused", lambda: "new config rejected" in agent.log.read_text(), timeout=60)
    log = agent.log.read_text()
    assert "new config rejected" in log and "csi.enabled: input should be a valid boolean" in log
    assert get(agent.url("/healthz"))[0] == 200
    assert (agent.root / "var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock").is_socket()
    assert agent.stop() == 0


def test_sigint_also_stops_gracefully(agent: AgentProcess) -> None:
    agent.proc.send_signal(signal.SIGINT)
    assert agent.proc.wait(timeout=30) == 0
    assert sockets_under(agent.root) == []
