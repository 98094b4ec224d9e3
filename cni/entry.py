"""``nodeplug-cni``: the executable a container runtime runs (installed as ``/opt/cni/bin/nodeplug``).

A thin client. Its start-up path imports the standard library only (no pyroute2, grpc or pydantic):

1. VERSION is answered here, without the agent;
2. otherwise the invocation (``CNI_*`` environment and the config text) goes to the warm agent over the unix socket
   named by the config's ``socket`` field (default ``/run/nodeplug/cni.sock``), whose answer is printed verbatim
   with its exit status (:mod:`cni.thick`);
3. when the socket is absent or the agent does not take the request in time (``agentTimeout`` seconds, default 2),
   the work is done here: :mod:`cni.skel` over :mod:`cni.commands` and :mod:`cni.dataplane`, imported only then.

``NODEPLUG_CNI_STANDALONE=1`` in the environment skips the agent (for benchmarks and debugging). Whatever happens,
stdout carries exactly one result or spec error JSON, and the exit status is 0 or 1.
"""

from __future__ import annotations

import os
import sys

from cni import thick, versions
from cni.errors import IO_FAILURE, TRY_AGAIN_LATER, CniError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import IO, Any, TextIO


def _route(stdin: bytes) -> tuple[str, float, str] | None:
    """(socket path, agent timeout, config text) when the config is readable enough to forward, else None (the
    standalone path then reports the precise error)."""
    try:
        text = stdin.decode()
        conf = thick.loads(text)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(conf, dict):
        return None
    ipam = conf.get("ipam")
    if not isinstance(ipam, dict):
        ipam = {}
    path = conf.get("socket", ipam.get("socket", thick.DEFAULT_SOCKET))
    timeout = conf.get("agentTimeout", thick.DEFAULT_AGENT_TIMEOUT)
    if not isinstance(path, str) or not path.startswith("/") or not thick.agent_timeout_ok(timeout):
        return None
    return path, float(timeout), text


def _standalone(env: Mapping[str, str], stdin: bytes, stdout: TextIO) -> int:
    from cni import commands, skel
    from cni.commands import Dataplane

    class LazyDataplane:
        """Imports pyroute2 (through cni.dataplane) only when netlink work is actually needed."""

        def __getattr__(self, name: str) -> Any:
            import cni.dataplane

            return getattr(cni.dataplane, name)

    dp: Dataplane = LazyDataplane()
    return skel.run(commands.table(dp), env, stdin, stdout)


def run(env: Mapping[str, str], stdin_stream: IO[bytes], stdout: TextIO) -> int:
    """One invocation; returns the exit status."""
    command = env.get("CNI_COMMAND", "")
    try:
        stdin = stdin_stream.read()
    except OSError as e:
        stdout.write(CniError(IO_FAILURE, details=f"cannot read the network config from stdin: {e}").to_json())
        return 1
    if command == "VERSION":
        stdout.write(thick.dumps(versions.version_info(_version_of(stdin))))
        return 0
    route = _route(stdin) if env.get("NODEPLUG_CNI_STANDALONE", "") in ("", "0") else None
    if route is not None and command:
        path, timeout, text = route
        cni_env = {k: v for k, v in env.items() if k.startswith("CNI_")}
        try:
            answer = thick.call(path, cni_env, text, connect_timeout=timeout, ack_timeout=timeout)
        except thick.AgentLost as e:
            stdout.write(CniError(TRY_AGAIN_LATER, details=f"{e}; retry the operation").to_json(_version_of(stdin)))
            return 1
        if answer is not None:
            code, out = answer
            stdout.write(out)
            return code
    return _standalone(env, stdin, stdout)


def _version_of(stdin: bytes) -> str:
    """Best effort: the config's cniVersion (the latest when stdin is empty or unreadable)."""
    try:
        conf = thick.loads(stdin.decode())
    except ValueError:  # UnicodeDecodeError is one too
        return versions.LATEST
    return versions.config_version(conf)


def main() -> None:
    code = run(os.environ, sys.stdin.buffer, sys.stdout)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
