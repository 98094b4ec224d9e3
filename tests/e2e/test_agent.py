"""The whole agent as a process: defaults under --root, health endpoints, reload, graceful stop."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent's plugins create loop devices and bridges"),
]

AGENT = [sys.executable, "-m", "nodeplug.cli", "agent"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Running:
    def __init__(self, proc: subprocess.Popen[str], port: int, root: Path, log: Path) -> None:
        self.proc, self.port, self.root, self.log = proc, port, root, log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if get(self.url("/healthz"))[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"agent not healthy within {timeout}s:\n{self.log.read_text()}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Running]:
    # a short root: kubelet's socket paths under it must fit sockaddr_un (107 bytes) for every client
    root = Path(tempfile.mkdtemp(prefix="npa-", dir="/tmp"))
    port = free_port()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"http:\n  address: 127.0.0.1:{port}\nshutdown_grace_seconds: 2\n")
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*AGENT, "--config", str(cfg), "--root", str(root)], stdout=out, stderr=subprocess.STDOUT, text=True
        )
    running = Running(proc, port, root, log)
    try:
        running.wait_healthy()
        yield running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def sockets_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_socket())


def test_defaults_serve_every_plugin_and_stop_cleanly(agent: Running) -> None:
    root = agent.root
    expected = [
        root / "var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock",
        root / "var/lib/kubelet/plugins_registry/local.csi.nodeplug.io-reg.sock",
        root / "run/nodeplug/cni.sock",
        root / "var/lib/kubelet/device-plugins/nodeplug-fuse.sock",
    ]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(p.exists() for p in expected):
        time.sleep(0.05)
    for p in expected:
        assert p.is_socket(), f"{p} missing; sockets: {sockets_under(root)}\n{agent.log.read_text()}"
        assert (p.stat().st_mode & 0o777) == 0o600, p

    status, body = get(agent.url("/readyz"))
    assert "csi:" in body and "cni:" in body and "deviceplugin:" in body
    # no kubelet here: the device plugin cannot register, so the agent is alive but not ready
    assert status == 503 and "deviceplugin: not ready" in body

    status, metrics = get(agent.url("/metrics"))
    assert status == 200 and "nodeplug_rpc_duration_seconds" in metrics
    assert get(agent.url("/nope"))[0] == 404

    assert agent.stop() == 0
    assert sockets_under(root) == [], agent.log.read_text()
    log = agent.log.read_text()
    assert "level=error" not in log, log


def test_bad_reload_keeps_the_running_config(agent: Running, tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    good = cfg.read_text()
    cfg.write_text(good + "csi:\n  enabled: maybe\n")
    agent.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "new config rejected" not in agent.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = agent.log.read_text()
    assert "new config rejected" in log and "csi.enabled: input should be a valid boolean" in log
    assert get(agent.url("/healthz"))[0] == 200
    assert (agent.root / "var/lib/kubelet/plugins/local.csi.nodeplug.io/csi.sock").is_socket()
    assert agent.stop() == 0


def test_sigint_also_stops_gracefully(agent: Running) -> None:
    agent.proc.send_signal(signal.SIGINT)
    assert agent.proc.wait(timeout=30) == 0
    assert sockets_under(agent.root) == []
