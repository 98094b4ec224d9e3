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

The client half is standard library only and lean (see "lean JSON" below): it is on the entry point's start-up path.
The server half (:func:`read_frame_async`) takes asyncio streams but does not import asyncio itself.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping
    from typing import Any

# How the entry point finds the agent, shared with the network config's parser (cni.netconf) so both agree.
DEFAULT_SOCKET = "/run/nodeplug/cni.sock"  # network config: socket
DEFAULT_AGENT_TIMEOUT = 2.0  # seconds to wait for the agent to take a request (network config: agentTimeout)


def agent_timeout_ok(v: Any) -> bool:
    """``agentTimeout`` is a number of seconds above 0 and at most 60 (a bool is not a number here)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v <= 60


ACK = b"\x06"
GO = b"\x07"
MAX_FRAME = 1 << 20
CONNECT_TIMEOUT = 1.0
ACK_TIMEOUT = 2.0
REPLY_TIMEOUT = 300.0


# ---------------------------------------------------------------- lean JSON
# The entry point's whole job in thick mode is a few hundred bytes of JSON and one socket round trip, so its start-up
# cost is mostly imports: ``json`` brings ``re`` and ``enum``, ``socket`` brings ``enum``, together about as much as
# the interpreter's own start. The client therefore uses the C halves directly: ``_json`` (scanner and string
# encoder) and ``_socket``. Where ``_json`` is missing (another interpreter) the ``json`` module is used instead.


class _ScanContext:
    """What ``_json.make_scanner`` reads from a JSONDecoder: strict JSON, plain dicts, no NaN/Infinity."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")


def _json_primitives() -> tuple[Any, Any]:
    try:
        import _json

        ctx: Any = _ScanContext()
        return _json.make_scanner(ctx), _json.encode_basestring_ascii
    except (ImportError, AttributeError):  # pragma: no cover - CPython always has _json
        import json

        return json.JSONDecoder().raw_decode, json.dumps


_scan, _quote = _json_primitives()

_WS = " \t\n\r"


def loads(text: str) -> Any:
    """``json.loads`` for a str, strict; ValueError on anything that is not exactly one JSON value."""
    stripped = text.strip(_WS)
    try:
        obj, end = _scan(stripped, 0)
    except StopIteration:
        raise ValueError("not a JSON document") from None
    except SystemError:
        # _json raises its syntax errors as json.decoder.JSONDecodeError, which it looks up in sys.modules only: with
        # json not yet imported it fails without an exception set. Import it now and let it name the problem.
        import json

        json.loads(stripped)
        raise ValueError("not a JSON document") from None  # pragma: no cover - json.loads has raised
    if end != len(stripped):
        raise ValueError(f"extra data after the JSON value at character {end}")
    return obj


def dumps(obj: Any) -> str:
    """Compact JSON for the client's messages: str, int, float, bool, None, lists and dicts of them."""
    if isinstance(obj, str):
        return str(_quote(obj))
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, int):
        return str(obj)
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, dict):
        return "{" + ",".join(f"{_quote(str(k))}:{dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in obj) + "]"
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


class ProtocolError(Exception):
    """The peer broke the framing (too large, not JSON, closed early)."""


class AgentLost(Exception):
    """The agent took the request (GO sent) but closed the connection or timed out before answering."""


def encode_frame(obj: Any) -> bytes:
    body = dumps(obj).encode()
    return len(body).to_bytes(4, "big") + body


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = loads(body.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"frame is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


def _recv_exact(sock: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError("connection closed")
        buf += chunk
    return bytes(buf)


def read_frame(sock: Any, max_size: int = MAX_FRAME) -> dict[str, Any]:
    n = int.from_bytes(_recv_exact(sock, 4), "big")
    if n > max_size:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_size}")
    return decode_body(_recv_exact(sock, n))


async def read_frame_async(reader: asyncio.StreamReader, max_size: int = MAX_FRAME) -> dict[str, Any]:
    n = int.from_bytes(await reader.readexactly(4), "big")
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
    import _socket  # the C module: socket.py would add enum to the start-up path

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
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
