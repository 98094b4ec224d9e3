"""A network namespace for a lab, with a thread living in it for socket work (sockets keep the netns they are made
in): the nodes, switch and router of :mod:`lab.clusterlab`, the control plane of :mod:`lab.controlplane`."""

from __future__ import annotations

import ctypes
import http.client
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lab.host import sh

CLONE_NEWNET = 0x40000000


class Netns:
    """A network namespace, and a thread living in it for socket work (sockets keep the netns they are made in)."""

    def __init__(self, name: str) -> None:
        self.name = name
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        self._pool: ThreadPoolExecutor | None = None

    def ip(self, *args: str, check: bool = True) -> str:
        return sh("ip", "-n", self.name, *args, check=check)

    def exec(self, *argv: str, check: bool = True, timeout: float = 60, input: str | None = None) -> str:
        return sh("ip", "netns", "exec", self.name, *argv, check=check, timeout=timeout, input=input)

    def popen(self, argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.name, *argv], stdout=out, stderr=subprocess.STDOUT, **kw
            )

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on this netns's own thread."""
        if self._pool is None:
            fd = os.open(f"/run/netns/{self.name}", os.O_RDONLY)

            def enter() -> None:  # this thread joins the namespace for good (setns(2), as ip netns exec does)
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {self.name}")

            self._pool = ThreadPoolExecutor(1, initializer=enter)
        return self._pool.submit(fn, *args).result()

    def http_get(self, port: int, path: str) -> tuple[int, str]:
        """GET ``path`` from 127.0.0.1:``port`` in this netns: (status, body), or (0, error) when nothing answers."""

        def go() -> tuple[int, str]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", path)
                r = conn.getresponse()
                return r.status, r.read().decode()
            finally:
                conn.close()

        try:
            return self.call(go)  # type: ignore[no-any-return]
        except OSError as e:
            return 0, str(e)

    def sysctl(self, key: str, value: str) -> None:
        self.exec("sysctl", "-qw", f"{key}={value}")

    def delete(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        sh("ip", "netns", "delete", self.name, check=False)
