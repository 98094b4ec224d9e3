"""A unix stream socket served by a thread of the test: the stand-in agents of the thick-mode tests."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from pathlib import Path


class UnixListener:
    """Listens at ``path``; a daemon thread accepts each connection, counts it and hands it to ``on_connect`` (which
    then owns it). :meth:`close` stops accepting and waits for the thread."""

    def __init__(self, path: Path, on_connect: Callable[[socket.socket], None]) -> None:
        self.path = path
        self.connections = 0
        self._on_connect = on_connect
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            self._on_connect(conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the serving thread
        self._sock.close()
        self._thread.join(5)
        assert not self._thread.is_alive()
