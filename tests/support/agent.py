"""The whole agent as a process, for the e2e tier (the ``spawn_agent`` fixture in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lab.host import free_port

__all__ = ["AgentProcess", "free_port"]


class AgentProcess:
    """``nodeplug agent --config <root>/agent.yaml --root <root>`` running, its output in ``<root>/agent.log``."""

    def __init__(self, root: Path, extra_config: str = "", own_group: bool = False) -> None:
        """``own_group``: the agent leads a process group of its own, so :meth:`kill_group` kills it with every
        command it runs, as a container runtime kills a container."""
        self.root = root
        self.port = free_port()
        self.config = root / "agent.yaml"
        self.config.write_text(f"http:\n  address: 127.0.0.1:{self.port}\nshutdown_grace_seconds: 2\n{extra_config}")
        self.log = root / "agent.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nodeplug.cli", "agent", "--config", str(self.config), "--root", str(root)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=own_group,
            )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited {self.proc.returncode}:\n{self.log.read_text()}")

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive()
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url("/healthz"), timeout=5) as r:
                if r.status == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"agent not healthy within {timeout}s:\n{self.log.read_text()}")

    def kill_group(self) -> None:
        """SIGKILL to the agent's process group (``own_group``): the agent and the commands it runs, at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)
