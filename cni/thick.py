"""Thick mode wire protocol between the exec'd entry point and the agent, over a unix stream socket.

One connection per invocation::

    client -> agent   frame  {"env": {"CNI_COMMAND": ..., ...}, "stdin": "<network config text>"}
    agent  -> client  ACK    one byte, sent as soon as the request is read
    client -> agent   GO     one byte: the client commits to the agent's answer
    agent  -> client  frame  {"exit": 0 | 1, "stdout": "<exactly what the plugin prints>"}

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON. The handshake makes the fallback safe:
the client waits a short time for ACK and, without it, does the work itself (the agent is down or stuck); the agent
runs nothing until it has GO, so an abandoned request is never also done by the agent. Once GO is sent the client
waits for the answer; if the agent dies before answering the client reports code 11 (try again later) instead of
redoing half-done work. The netns travels by path (``CNI_NETNS``), which the agent resolves in the host's view.

The client half is standard library only (``socket``, ``json``, ``struct``): it is on the entry point's start-up
path. The server half (:func:`read_frame_async`) takes asyncio streams but does not import asyncio itself.
"""

from __future__ import annotations

import json
import socket
import struct

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping
    from typing import Any

ACK = b"\x06"
GO = b"\x07"
MAX_FRAME = 1 << 20
CONNECT_TIMEOUT = 1.0
ACK_TIMEOUT = 2.0
REPLY_TIMEOUT = 300.0
_LEN = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer broke the framing (too large, not JSON, closed early)."""


class AgentLost(Exception):
    """The agent took the request (GO sent) but closed the connection or timed out before answering."""


def encode_frame(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"frame is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError("connection closed")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket, max_size: int = MAX_FRAME) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > max_size:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_size}")
    return decode_body(_recv_exact(sock, n))


async def read_frame_async(reader: asyncio.StreamReader, max_size: int = MAX_FRAME) -> dict[str, Any]:
    head = await reader.readexactly(_LEN.size)
    (n,) = _LEN.unpack(head)
    if n > max_size:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_size}")
    return decode_body(await reader.readexactly(n))


def parse_request(obj: Mapping[str, Any]) -> tuple[dict[str, str], bytes]:
    """A request frame -> (env, stdin bytes); ProtocolError when its shape is wrong."""
    env, stdin = obj.get("env"), obj.get("stdin")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ProtocolError("request env must be an object of strings")
    if not isinstance(stdin, str):
        raise ProtocolError("request stdin must be a string")
    return env, stdin.encode()


def call(
    path: str,
    env: Mapping[str, str],
    stdin: str,
    connect_timeout: float = CONNECT_TIMEOUT,
    ack_timeout: float = ACK_TIMEOUT,
    reply_timeout: float = REPLY_TIMEOUT,
) -> tuple[int, str] | None:
    """Have the agent at ``path`` run the invocation: (exit status, stdout), or None when the agent is not there
    (no socket, refused, no ACK in time) and the caller should do the work itself. Raises :class:`AgentLost` when
    the agent accepted the work and then failed to answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(connect_timeout)
        try:
            sock.connect(path)
            sock.sendall(encode_frame({"env": dict(env), "stdin": stdin}))
            sock.settimeout(ack_timeout)
            if _recv_exact(sock, 1) != ACK:
                return None
            sock.sendall(GO)
        except (OSError, ProtocolError):  # absent, refused, timed out, closed: the agent is not serving
            return None
        sock.settimeout(reply_timeout)
        try:
            reply = read_frame(sock)
        except TimeoutError:
            raise AgentLost(f"the agent at {path} did not answer within {reply_timeout:g}s") from None
        except (OSError, ProtocolError) as e:
            raise AgentLost(f"the agent at {path} failed before answering: {e}") from None
        code, out = reply.get("exit"), reply.get("stdout")
        if not isinstance(code, int) or not isinstance(out, str):
            raise AgentLost(f"the agent at {path} sent a malformed answer")
        return code, out
    finally:
        sock.close()
