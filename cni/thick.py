"""Thick mode: the exec'd entry point hands its invocation to the warm agent over a unix stream socket.

One connection per invocation, a binary framing (no JSON on the wire: the request carries the environment and stdin
as bytes, the reply the exit status and stdout as bytes), and a handshake that makes the fallback safe::

    client -> agent   request  MAGIC, u32 env length, u32 stdin length, env block, stdin
    agent  -> client  ACK      one byte: the request is read and is this agent's; it runs on GO
                      NOT_HERE one byte: the config names another agent's socket (the client asks that one, or does
                               the work itself); the connection ends
                      NAK      one byte and a reply: answered without running (larger than the agent accepts, so
                               refused before it is read: a client that has not read the config either (the
                               launcher) hands it to one that has, which asks the socket the config names)
    client -> agent   GO       one byte: the client commits to the agent's answer
    agent  -> client  reply    u8 exit status (0 or 1), u32 stdout length, stdout

Integers are big-endian. The env block is the ``CNI_*`` variables as ``KEY=VALUE`` entries, each ended by a NUL
byte (the layout of ``/proc/PID/environ``); text is UTF-8 with surrogate escapes, as ``os.environ`` decodes it.

The client waits a bounded time for ACK and, without it, does the work itself (the agent is down or stuck); the agent
runs nothing until it has GO, so an abandoned request is never also done by the agent. Once GO is sent the client
waits for the answer; if the agent dies before answering the client reports code 11 (try again later) instead of
redoing half-done work. The netns travels by path (``CNI_NETNS``), which the agent resolves in the host's view.

There is one client per language: :func:`call` here (the Python entry point, :mod:`cni.entry`) and the bundle's C
launcher (``cni/launcher/fastpath.c``, its constants generated from this module); the server is the agent's
(:mod:`cni.thickserver`, for :mod:`cni.plugin`), which uses :func:`parse_header`, :func:`parse_body`,
:func:`routes_here` and :func:`encode_reply`. The launcher cannot read the config (it parses no JSON), so it asks the
agent at its own socket (``$NODEPLUG_CNI_SOCKET``, else the one ``nodeplug install-cni`` recorded for the conflist it
wrote in the file :data:`SOCKET_RECORD` of ``nodeplug.d/``, beside the bundles, else :data:`DEFAULT_SOCKET`) and the
agent answers NOT_HERE for a config naming another; when its wait for ACK runs out it hands the open connection to the
Python entry point (``NODEPLUG_CNI_AGENT_FD``, ``NODEPLUG_CNI_AGENT_WAITED``), which waits out the rest of the config's
``agentTimeout`` on it: a stuck agent costs one wait, never two, and gets one request.

Standard library only, and nothing is imported at module level: this is on the entry point's start-up path.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    import socket
    from collections.abc import Mapping
    from typing import Any

# How the entry point finds the agent, shared with the network config's parser (cni.netconf) so both agree.
DEFAULT_SOCKET = "/run/nodeplug/cni.sock"  # network config: socket
DEFAULT_AGENT_TIMEOUT = 2.0  # seconds to wait for the agent to take a request (network config: agentTimeout)

SOCKET_RECORD = "agent-socket"  # in the CNI bin dir's nodeplug.d/: the socket the installed conflist names
MAGIC = b"NPC\x01"  # a request starts with this; the last byte is the protocol version
HEADER_SIZE = len(MAGIC) + 8
REPLY_HEADER_SIZE = 5
ACK = b"\x06"
GO = b"\x07"
NAK = b"\x15"
NOT_HERE = b"\x18"
MAX_STDIN = 64 << 20  # the largest network config the entry point reads (the agent's own limit is its config's)
MAX_REPLY = 4 << 20
LAUNCHER_ACK_WAIT = 0.5  # seconds the C launcher waits for ACK before handing the connection to the entry point
REPLY_TIMEOUT = 300.0

# Set by the C launcher for the Python entry point it starts (never by a runtime); removed from the environment first.
ENV_SOCKET = "NODEPLUG_CNI_SOCKET"  # the launcher's socket (default DEFAULT_SOCKET)
ENV_AGENT_FD = "NODEPLUG_CNI_AGENT_FD"  # a connection the launcher sent the request on and had no ACK for yet
ENV_AGENT_WAITED = "NODEPLUG_CNI_AGENT_WAITED"  # seconds the launcher already waited on it
ENV_AGENT_TRIED = "NODEPLUG_CNI_AGENT_TRIED"  # the socket the launcher found absent, refusing or closing on it
ENV_AGENT_LOST = "NODEPLUG_CNI_AGENT_LOST"  # the agent took the request (GO sent) and failed: why
ENV_STDIN_FAILED = "NODEPLUG_CNI_STDIN_FAILED"  # the launcher could not read stdin: why (stdin is not replayed)
LAUNCHER_ENV = (ENV_AGENT_FD, ENV_AGENT_WAITED, ENV_AGENT_TRIED, ENV_AGENT_LOST, ENV_STDIN_FAILED)


def waited(text: str) -> float:
    """Seconds the launcher already waited for the agent, from ``NODEPLUG_CNI_AGENT_WAITED``: a finite number >= 0 as
    the launcher writes it, else (negative, NaN, infinite, not a number) the whole wait counts as used up (inf), so
    the entry point never waits longer than ``agentTimeout`` in all."""
    try:
        value = float(text)
    except ValueError:
        return float("inf")
    return value if 0 <= value < float("inf") else float("inf")


def agent_timeout_ok(v: Any) -> bool:
    """``agentTimeout`` is a number of seconds above 0 and at most 60 (a bool is not a number here)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v <= 60


def route(conf: Any) -> tuple[str, float] | None:
    """(socket, agent timeout) a decoded config sends its invocations to; None when the config is not an object or
    these fields are malformed (the standalone path then reports the precise error)."""
    if not isinstance(conf, dict):
        return None
    ipam = conf.get("ipam")
    path = conf.get("socket", ipam.get("socket", DEFAULT_SOCKET) if isinstance(ipam, dict) else DEFAULT_SOCKET)
    timeout = conf.get("agentTimeout", DEFAULT_AGENT_TIMEOUT)
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or not agent_timeout_ok(timeout):
        return None
    return path, float(timeout)


def same_socket(a: str, b: str) -> bool:
    """Two spellings of one socket path (``//run/x/../x/cni.sock``); the filesystem is not consulted."""
    import posixpath

    return posixpath.normpath(a) == posixpath.normpath(b)


class ProtocolError(Exception):
    """The peer broke the framing (bad magic, too large, malformed, closed early)."""


class AgentLost(Exception):
    """The agent took the request (GO sent) but closed the connection or timed out before answering."""


# ---------------------------------------------------------------- framing


def encode_env(env: Mapping[str, str]) -> bytes:
    """The env block: the ``CNI_*`` variables of ``env`` as NUL-ended ``KEY=VALUE`` entries."""
    return b"".join(f"{k}={v}".encode("utf-8", "surrogateescape") + b"\0" for k, v in env.items() if _forwarded(k, v))


def _forwarded(key: str, value: str) -> bool:
    return key.startswith("CNI_") and "=" not in key and "\0" not in key + value


def encode_request(env: Mapping[str, str], stdin: bytes) -> bytes:
    block = encode_env(env)
    return MAGIC + len(block).to_bytes(4, "big") + len(stdin).to_bytes(4, "big") + block + stdin


def parse_header(header: bytes) -> tuple[int, int]:
    """(env block length, stdin length) of a request header; ProtocolError unless it starts with :data:`MAGIC`."""
    if len(header) != HEADER_SIZE or header[: len(MAGIC)] != MAGIC:
        raise ProtocolError("not a nodeplug thick-mode request (bad magic)")
    return int.from_bytes(header[4:8], "big"), int.from_bytes(header[8:12], "big")


def parse_env(block: bytes) -> dict[str, str]:
    """An env block -> the ``CNI_*`` variables; ProtocolError for anything else."""
    if block and not block.endswith(b"\0"):
        raise ProtocolError("env block: the last entry is not NUL-terminated")
    env: dict[str, str] = {}
    for entry in block.split(b"\0")[:-1]:
        key, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if not sep or not key.startswith("CNI_"):
            raise ProtocolError(f"env block: expected CNI_KEY=VALUE entries, got {entry[:40]!r}")
        env[key] = value
    return env


def parse_body(body: bytes, env_size: int) -> tuple[dict[str, str], bytes]:
    """The bytes after the header -> (env, stdin)."""
    return parse_env(body[:env_size]), body[env_size:]


def encode_reply(code: int, stdout: bytes) -> bytes:
    return bytes((code,)) + len(stdout).to_bytes(4, "big") + stdout


def parse_reply_header(header: bytes) -> tuple[int, int]:
    """(exit status, stdout length); ProtocolError unless the status is 0 or 1 and the length within bounds."""
    if len(header) != REPLY_HEADER_SIZE or header[0] not in (0, 1):
        raise ProtocolError("malformed answer")
    size = int.from_bytes(header[1:], "big")
    if size > MAX_REPLY:
        raise ProtocolError(f"answer of {size} bytes exceeds the limit of {MAX_REPLY}")
    return header[0], size


def routes_here(stdin: bytes, own_socket: str) -> bool:
    """Whether a request's config is for the agent serving ``own_socket``: it names that socket (or names none and
    that is the default one), or it cannot be routed at all (the agent then answers the config's error itself)."""
    from cni import strictjson

    try:
        where = route(strictjson.loads(stdin))
    except ValueError:
        return True
    return where is None or same_socket(where[0], own_socket)


# ---------------------------------------------------------------- the Python client


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking socket (its timeout applies to each read); ProtocolError when the peer
    closes first. Frames are read with it on either side: a reply here, a request in a stand-in agent."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError("connection closed")
        buf += chunk
    return bytes(buf)


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    code, size = parse_reply_header(recv_exact(sock, REPLY_HEADER_SIZE))
    return code, recv_exact(sock, size)


def connect(path: str, timeout: float) -> socket.socket | None:
    """A connection to the agent at ``path``, or None when nobody serves it."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def call(
    path: str,
    env: Mapping[str, str],
    stdin: bytes,
    timeout: float = DEFAULT_AGENT_TIMEOUT,
    reply_timeout: float = REPLY_TIMEOUT,
) -> tuple[int, bytes] | None:
    """Have the agent at ``path`` run the invocation: (exit status, stdout), or None when the agent is not there
    (no socket, refused, no ACK within ``timeout``, or NOT_HERE) and the caller should do the work itself. Raises
    :class:`AgentLost` when the agent accepted the work and then failed to answer."""
    sock = connect(path, timeout)
    if sock is None:
        return None
    with sock:
        try:  # noqa: SIM105 - no contextlib on the start-up path
            sock.sendall(encode_request(env, stdin))
        except OSError:
            pass  # the agent may have answered NAK and stopped reading (a request too large): look for its answer
        return finish(sock, path, timeout, reply_timeout)


def finish(
    sock: socket.socket, path: str, ack_wait: float, reply_timeout: float = REPLY_TIMEOUT
) -> tuple[int, bytes] | None:
    """After the request is sent on ``sock``: wait up to ``ack_wait`` seconds for the agent to take it, then GO and
    its answer (see :func:`call`)."""
    try:
        sock.settimeout(ack_wait if ack_wait > 0 else 0.0)  # 0: only an answer already there
        first = recv_exact(sock, 1)
        if first == NAK:
            sock.settimeout(reply_timeout)
            return read_reply(sock)
        if first != ACK:
            return None  # NOT_HERE, or not speaking this protocol
        sock.sendall(GO)
    except (OSError, ProtocolError):  # absent, refused, timed out, closed: the agent is not serving
        return None
    sock.settimeout(reply_timeout)
    try:
        return read_reply(sock)
    except TimeoutError:
        raise AgentLost(f"the agent at {path} did not answer within {reply_timeout:g}s") from None
    except (OSError, ProtocolError) as e:
        raise AgentLost(f"the agent at {path} failed before answering: {e}") from None
