"""The agent's side of thick mode (:mod:`cni.thick`): a unix stream socket whose connections are each served whole on a
thread, with blocking calls.

One thread accepts; each connection then goes to a pool thread that reads the request, answers ACK (or NOT_HERE, or
NAK with the error for a request larger than ``max_request_bytes``), waits for GO, runs the invocation through the
``run`` callable it was given and writes the answer. Reading the request and waiting for GO are each bounded by
``handshake_timeout``, so a client that stalls holds its thread for at most that long; at most ``connections``
connections are served at once and later ones, accepted, wait for a thread (their clients do the work themselves once
their wait for ACK runs out, and the agent runs nothing it has no GO for). How many invocations *run* at once is the
caller's business (:mod:`cni.plugin`).

Why threads and not the agent's event loop: the command runs on a thread anyway, and serving the framing on the loop
handed each request back and forth between the loop and a worker five times (accept, request, ACK, GO, answer), each
hand-over a wake-up and a change of the thread holding the interpreter lock. Under twenty pods started at once those
hand-overs were about a third of the agent's CPU time. A thread blocked in ``accept``, ``recv`` or ``poll`` holds no
lock, so the threads of requests in flight cost nothing while they wait.

The socket file is created with mode 0600 by ``bind`` itself (the mode is set on the socket before it has a name),
so it is never connectable by others, whatever the umask.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cni import thick
from cni.errors import INVALID_NETWORK_CONFIG, CniError
from nodeplug.grpcserve import remove_stale_socket
from nodeplug.log import Logger

Runner = Callable[[dict[str, str], bytes], tuple[int, str]]  # (env, stdin) -> (exit status, stdout)
_READ_SIZE = 1 << 16


class ThickServer:
    def __init__(
        self,
        path: Path,
        run: Runner,
        *,
        connections: int,
        max_request_bytes: int,
        handshake_timeout: float,
        log: Logger,
    ) -> None:
        self.path = path
        self.run = run
        self.connections = connections
        self.max_request_bytes = max_request_bytes
        self.handshake_timeout = handshake_timeout
        self.log = log
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._guard = threading.Condition()
        self._queued: set[socket.socket] = set()  # accepted, not yet taken by a pool thread
        self._active: set[socket.socket] = set()  # being served

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(self.path)  # from a previous run: nobody can be serving it (we are the agent)
        listener = _listening_socket(self.path)
        pool = ThreadPoolExecutor(self.connections, thread_name_prefix="cni")
        acceptor = threading.Thread(target=self._accept_loop, args=(listener, pool), name="cni-accept", daemon=True)
        try:
            acceptor.start()
        except BaseException:  # no thread to serve it: no socket left behind that nobody answers
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            pool.shutdown(wait=False)
            raise
        self._listener, self._pool, self._acceptor = listener, pool, acceptor

    @property
    def serving(self) -> bool:
        return self._acceptor is not None and self._acceptor.is_alive()

    def stop(self, grace: float) -> None:
        """Stop accepting, remove the socket, give the connections in flight ``grace`` seconds, then close them (a
        client that sent GO then reports the agent lost; the invocation itself runs to its end on its thread).
        Blocks: the agent calls it from a thread of its own."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor (accept fails with EINVAL)
            if self._acceptor is not None:
                self._acceptor.join()
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        pool, self._pool = self._pool, None
        deadline = time.monotonic() + grace
        with self._guard:
            while self._active or self._queued:
                left = deadline - time.monotonic()
                if left <= 0 or not self._guard.wait(left):
                    break
            for conn in self._active:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # its thread wakes, fails its read or write and closes it
            queued, self._queued = self._queued, set()
        for conn in queued:  # never taken: nobody else holds them
            conn.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ serving

    def _accept_loop(self, listener: socket.socket, pool: ThreadPoolExecutor) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as e:
                if self._listener is not listener:
                    return  # stopping
                self.log.warning("CNI socket: accept failed", error=str(e))  # e.g. out of file descriptors
                time.sleep(0.1)
                continue
            with self._guard:
                self._queued.add(conn)
            try:
                pool.submit(self._handle, conn)
            except RuntimeError:  # the pool is shutting down
                with self._guard:
                    self._queued.discard(conn)
                conn.close()
                return

    def _handle(self, conn: socket.socket) -> None:
        with self._guard:
            if conn not in self._queued:
                return  # closed by stop
            self._queued.remove(conn)
            self._active.add(conn)
        try:
            self._serve(conn)
        except (OSError, thick.ProtocolError) as e:  # TimeoutError and ConnectionError are OSErrors
            self.log.debug("CNI client went away", error=str(e) or type(e).__name__)
        except Exception:
            self.log.error("CNI connection failed", exc_info=True)
        finally:
            with self._guard:
                self._active.discard(conn)
                self._guard.notify_all()
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        deadline = time.monotonic() + self.handshake_timeout
        env_size, stdin_size = thick.parse_header(_read(conn, buf, thick.HEADER_SIZE, deadline))
        size = env_size + stdin_size
        if size > self.max_request_bytes:
            self._refuse(conn, size, unread=size - len(buf))
            return
        env, stdin = thick.parse_body(_read(conn, buf, size, deadline), env_size)
        conn.settimeout(self.handshake_timeout)
        if not thick.routes_here(stdin, str(self.path)):
            conn.sendall(thick.NOT_HERE)
            return
        conn.sendall(thick.ACK)
        if _read(conn, buf, 1, time.monotonic() + self.handshake_timeout) != thick.GO:
            raise thick.ProtocolError("expected GO after ACK")
        code, out = self.run(env, stdin)
        conn.settimeout(self.handshake_timeout)
        conn.sendall(thick.encode_reply(code, out.encode()))

    def _refuse(self, conn: socket.socket, size: int, unread: int) -> None:
        """NAK a request larger than ``max_request_bytes`` with an error naming the limit, and read the rest of it
        away (for at most the handshake timeout) so the client, still sending, gets to read the answer."""
        limit = self.max_request_bytes
        err = CniError(
            INVALID_NETWORK_CONFIG,
            details=f"the request ({size} bytes of environment and network config) is larger than the agent "
            f"accepts ({limit} bytes: cni.max_request_bytes in the agent config)",
        )
        self.log.warning("CNI request refused", size=size, limit=limit)
        conn.settimeout(self.handshake_timeout)
        conn.sendall(thick.NAK + thick.encode_reply(1, err.to_json().encode()))
        deadline = time.monotonic() + self.handshake_timeout
        with contextlib.suppress(OSError):
            while unread > 0 and (left := deadline - time.monotonic()) > 0:
                conn.settimeout(left)
                chunk = conn.recv(min(unread, _READ_SIZE))
                if not chunk:
                    break
                unread -= len(chunk)


def _read(conn: socket.socket, buf: bytearray, n: int, deadline: float) -> bytes:
    """The next ``n`` bytes of the connection (``buf`` holds what an earlier read took beyond its own), all of them
    before ``deadline``: TimeoutError after it, ProtocolError when the client closes first."""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client did not send its request in time")
        conn.settimeout(left)
        chunk = conn.recv(max(n - len(buf), _READ_SIZE))
        if not chunk:
            raise thick.ProtocolError("connection closed")
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _listening_socket(path: Path) -> socket.socket:
    """A unix stream socket listening at ``path`` whose file is born with mode 0600: on Linux ``bind`` gives the file
    the socket's own mode (less the umask), so it is set first; there is no moment when others may connect."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(str(path))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock
