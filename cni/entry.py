"""``nodeplug-cni``: the executable a container runtime runs (installed as ``/opt/cni/bin/nodeplug``).

A thin client. Its start-up path imports the standard library only (no grpc or pydantic, no dataplane):

1. VERSION is answered here, without the agent (:func:`cni.versions.version_answer`);
2. otherwise the invocation (``CNI_*`` environment and stdin) goes to the warm agent over the unix socket named by
   the config's ``socket`` field (default ``/run/nodeplug/cni.sock``), whose answer is printed verbatim with its
   exit status (:mod:`cni.thick`);
3. when the socket is absent or the agent does not take the request in time (``agentTimeout`` seconds, default 2),
   the work is done here: :mod:`cni.skel` over :mod:`cni.commands` and :mod:`cni.dataplane`, imported only then.

The bundle's C launcher runs this when it cannot finish the invocation itself, and says why in variables it sets
(:data:`cni.thick.LAUNCHER_ENV`): the agent it already asked (never asked twice, never waited for twice), a
connection it handed on with the time already spent waiting, an agent lost after GO (code 11), or stdin it could not
read (code 5; stdin is never replayed in part).

``NODEPLUG_CNI_STANDALONE=1`` in the environment skips the agent (for benchmarks and debugging). Whatever the bytes
on stdin and the environment, stdout carries exactly one result or spec error JSON (nothing after a successful DEL,
CHECK, GC or STATUS), and the exit status is 0 or 1.

A standalone invocation is one short process, and start-up is most of its cost: the cyclic garbage collector is off
(it would only run during the imports) and the process ends with ``os._exit`` once the answer is flushed, skipping
the interpreter's teardown of every module it imported (a sixth of a standalone ADD): there is nothing to tear
down, as every IPAM transaction is committed before the answer is written, which is what a kill -9 at that moment
would leave too. A thread still finishing a veth's deletion (:mod:`cni.dataplane.unlink`) ends with the process
once its system call returns; the kernel completes the deletion either way.
"""

from __future__ import annotations

import os
import sys

from cni import strictjson, thick, versions
from cni.errors import INVALID_NETWORK_CONFIG, IO_FAILURE, TRY_AGAIN_LATER, CniError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    import socket
    from collections.abc import Mapping
    from typing import IO, Any, TextIO

    from cni.skel import Handler


class _TooLarge(Exception):
    pass


def _read(stream: IO[bytes]) -> bytes:
    """All of stdin, at most :data:`cni.thick.MAX_STDIN` bytes (_TooLarge beyond; OSError when unreadable)."""
    data = stream.read(thick.MAX_STDIN + 1)
    if len(data) > thick.MAX_STDIN:
        raise _TooLarge
    return data


def _standalone(env: Mapping[str, str], stdin: bytes, stdout: TextIO, handlers: Mapping[str, Handler] | None) -> int:
    from cni import commands, skel
    from cni.commands import Dataplane

    if handlers is None:

        class LazyDataplane:
            """Imports the dataplane only when netlink work is actually needed."""

            def __getattr__(self, name: str) -> Any:
                import cni.dataplane

                return getattr(cni.dataplane, name)

        dp: Dataplane = LazyDataplane()
        handlers = commands.table(dp)
    return skel.run(handlers, env, stdin, stdout)


def _handed(env: Mapping[str, str]) -> tuple[socket.socket, float] | None:
    """The connection the launcher handed on (a socket it sent the request on) and how long it already waited."""
    fd_text, waited_text = env.get(thick.ENV_AGENT_FD, ""), env.get(thick.ENV_AGENT_WAITED, "0")
    if not (fd_text.isascii() and fd_text.isdigit()) or not 2 < int(fd_text) <= 0x7FFFFFFF:  # as the launcher writes
        return None
    import socket
    import stat

    fd = int(fd_text)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
    except OSError:
        return None
    os.set_inheritable(fd, False)
    return socket.socket(fileno=fd), thick.waited(waited_text)


def _ask_agent(env: Mapping[str, str], stdin: bytes) -> tuple[int, bytes] | None:
    """The agent's answer, or None when the work is to be done here. Raises :class:`cni.thick.AgentLost`."""
    handed = _handed(env)
    try:
        where = thick.route(strictjson.loads(stdin))
    except ValueError:
        where = None
    tried = env.get(thick.ENV_AGENT_TRIED, "")
    if where is not None and tried and thick.same_socket(where[0], tried):
        if handed is None:
            return None  # the launcher found nobody serving it
        sock, waited = handed
        with sock:
            return thick.finish(sock, where[0], where[1] - waited)
    if handed is not None:
        handed[0].close()  # another agent's (or no agent's) connection: it never gets GO
    if where is None:
        return None
    path, timeout = where
    return thick.call(path, {k: v for k, v in env.items() if k.startswith("CNI_")}, stdin, timeout)


def run(
    env: Mapping[str, str], stdin_stream: IO[bytes], stdout: TextIO, handlers: Mapping[str, Handler] | None = None
) -> int:
    """One invocation; returns the exit status. ``handlers`` replaces the standalone command table (tests)."""
    command = env.get("CNI_COMMAND", "")
    failed = env.get(thick.ENV_STDIN_FAILED)
    try:
        if failed == "too large":
            raise _TooLarge
        if failed is not None:
            raise OSError(failed)
        stdin = _read(stdin_stream)
    except (OSError, _TooLarge) as e:
        if command == "VERSION":
            stdout.write(versions.version_answer())
            return 0
        too_large = isinstance(e, _TooLarge)
        err = CniError(
            INVALID_NETWORK_CONFIG if too_large else IO_FAILURE,
            details=f"the network config on stdin is larger than {thick.MAX_STDIN} bytes"
            if too_large
            else f"cannot read the network config from stdin: {e}",
        )
        stdout.write(err.to_json())
        return 1
    if command == "VERSION":
        stdout.write(versions.version_answer())
        return 0
    lost = env.get(thick.ENV_AGENT_LOST)
    if lost:
        return _try_again_later(lost, stdin, stdout)
    if command and env.get("NODEPLUG_CNI_STANDALONE", "") in ("", "0"):
        try:
            answer = _ask_agent(env, stdin)
        except thick.AgentLost as e:
            return _try_again_later(str(e), stdin, stdout)
        if answer is not None:
            code, out = answer
            stdout.write(out.decode("utf-8", "replace"))
            return code
    return _standalone(env, stdin, stdout, handlers)


def _try_again_later(why: str, stdin: bytes, stdout: TextIO) -> int:
    """The agent took the request and was lost before answering: code 11, never the work redone here."""
    err = CniError(TRY_AGAIN_LATER, details=f"{why}; retry the operation")
    stdout.write(err.to_json(versions.stdin_version(stdin)))
    return 1


def main() -> None:
    import gc

    gc.disable()  # one short invocation: the cyclic collector would only run during the imports, finding nothing
    env = dict(os.environ)
    for key in thick.LAUNCHER_ENV:  # the launcher's notes are for this process only, not for the commands it runs
        os.environ.pop(key, None)
    code = run(env, sys.stdin.buffer, sys.stdout)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # nothing to tear down: the answer is out, every store transaction committed
        os._exit(code)


if __name__ == "__main__":
    main()
