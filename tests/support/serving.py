"""Sockets a test serves from its own threads (the servers its pods and namespaces answer with), stopped safely.

Closing a socket under a thread blocked in ``accept`` or ``recvfrom`` does not wake that thread: it goes on
waiting on the old socket, and its next call uses a descriptor number the process may since have given to
another socket (an agent's, another test's), reading what was meant for it. :meth:`Serving.close` shuts each
socket down first, which wakes its thread (``accept`` fails, ``recvfrom`` returns no sender), waits for the
threads, and only then closes the sockets. A serving loop may close its own socket when done with it (a
connection it answered): Python forgets a closed socket's descriptor, so nothing here touches it again."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

JOIN = 10.0  # seconds to wait for a woken thread; only a hang takes that long


class Serving:
    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []

    def serve(self, sock: socket.socket, loop: Callable[[socket.socket], None]) -> socket.socket:
        """Run ``loop(sock)`` in a daemon thread until :meth:`close`; ``sock`` back."""
        thread = threading.Thread(target=loop, args=(sock,), daemon=True)
        self.socks.append(sock)
        self.threads.append(thread)
        thread.start()
        return sock

    def connections(self, listener: socket.socket, handle: Callable[[socket.socket], None]) -> socket.socket:
        """Serve ``listener``: each connection it accepts handled by ``handle`` on a thread of its own (which
        :meth:`close` wakes too; ``handle`` may close the connection when done); ``listener`` back."""

        def accept(s: socket.socket) -> None:
            with contextlib.suppress(OSError):  # shut down
                while True:
                    self.serve(s.accept()[0], handle)

        return self.serve(listener, accept)

    def close(self) -> None:
        done = 0
        while done < len(self.socks):  # a connection accepted meanwhile is served too: shut it down in the next turn
            upto = len(self.socks)
            for s in self.socks[done:upto]:
                with contextlib.suppress(OSError):  # ENOTCONN from an unconnected datagram socket, which it wakes
                    s.shutdown(socket.SHUT_RDWR)
            for t in self.threads[done:upto]:
                t.join(JOIN)
            done = upto
        for s in self.socks:
            s.close()
        stuck = [t.name for t in self.threads if t.is_alive()]
        assert not stuck, f"serving threads still running after their sockets were shut down: {stuck}"


def echo_datagrams(s: socket.socket) -> None:
    """A serving loop: each datagram back to its sender, until the socket is shut down."""
    with contextlib.suppress(OSError):
        while True:
            data, peer = s.recvfrom(65535)
            if peer is None:  # shut down
                return
            s.sendto(data, peer)
