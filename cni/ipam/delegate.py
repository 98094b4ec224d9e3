"""Delegated plugin execution (CNI spec 1.1.0, "Delegated plugin protocol").

When ``ipam.type`` is not ``nodeplug`` the IPAM work goes to that plugin: its executable is looked up in the
``CNI_PATH`` directories, and it is run with the same ``CNI_*`` environment (``CNI_COMMAND`` set to the command being
delegated) and exactly the network config the runtime gave us on stdin. A non-zero exit carries the delegate's own
error JSON, which is passed on unchanged (code, msg, details).

The child gets an explicit environment (the request's ``CNI_*`` variables, not this process's): in the agent many
requests run at once, each with its own; and a non-zero exit's stdout matters. That is why this runs the child itself
rather than through ``nodeplug.commands.run`` (process environment, stdout dropped on failure); it keeps that
helper's rules: argument list, no shell, a timeout (the child's whole session is killed), errors naming the command
and its stderr. ``subprocess`` and ``signal`` are imported when a delegate is actually run: a standalone CNI exec with
the built-in IPAM never pays for them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from cni import strictjson
from cni.errors import DELEGATE, INVALID_NETWORK_CONFIG, TRY_AGAIN_LATER, CniError
from cni.types import Result

DEFAULT_TIMEOUT = 60.0
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def find_plugin(plugin_type: str, cni_path: Sequence[str]) -> str:
    """The first ``<dir>/<type>`` in CNI_PATH that is an executable file (code 7 naming the type otherwise)."""
    if "/" in plugin_type or plugin_type in ("", ".", ".."):
        raise CniError(INVALID_NETWORK_CONFIG, details=f"ipam.type: expected a plugin file name, got {plugin_type!r}")
    for d in cni_path:
        p = os.path.join(d, plugin_type)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    raise CniError(
        INVALID_NETWORK_CONFIG,
        details=f"ipam.type: plugin {plugin_type!r} not found in CNI_PATH {':'.join(cni_path) or '(empty)'}",
    )


def _run(exe: str, command: str, env: Mapping[str, str], stdin: bytes, timeout: float) -> tuple[int, bytes, bytes]:
    """Run in its own session so a timeout kills the plugin and anything it started (which would otherwise hold
    its output pipes open past the timeout)."""
    import signal
    import subprocess

    # Popen rather than nodeplug.commands.run, which cannot do any of: a per-request env (the agent runs many requests
    # at once), the child's stdout when it fails (its error JSON), and killing its whole process group on timeout.
    try:
        proc = subprocess.Popen(
            [exe],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            close_fds=True,
            start_new_session=True,
        )
    except OSError as e:
        raise CniError(DELEGATE, details=f"{exe} {command} could not be run: {e}") from None
    with proc:
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            # a plugin that does not finish in time on a loaded node: the runtime should try again later
            raise CniError(TRY_AGAIN_LATER, details=f"{exe} {command} timed out after {timeout:g}s") from None
    return proc.returncode, out, err


def exec_plugin(
    plugin_type: str,
    command: str,
    cni_env: Mapping[str, str],
    stdin: bytes,
    cni_path: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, Any] | None:
    """Run the delegate; its parsed stdout for ADD (and any command that prints), None when it prints nothing."""
    exe = find_plugin(plugin_type, cni_path)
    env = {"PATH": os.environ.get("PATH", _DEFAULT_PATH), **cni_env, "CNI_COMMAND": command}
    returncode, stdout, stderr = _run(exe, command, env, stdin, timeout)
    out = stdout.strip()
    if returncode != 0:
        try:
            data = strictjson.loads(out) if out else None
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("code"), int):
            raise CniError.from_dict(data, str(exe))
        err = stderr.decode(errors="replace").strip() or out.decode(errors="replace")
        raise CniError(DELEGATE, details=f"{exe} {command} exited with status {returncode}: {err[:500]}")
    if not out:
        return None
    try:
        data = strictjson.loads(out)
    except ValueError as e:
        raise CniError(DELEGATE, details=f"{exe} {command} printed something that is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise CniError(DELEGATE, details=f"{exe} {command} printed a JSON {type(data).__name__}, expected an object")
    return data


def ipam_add(
    plugin_type: str,
    cni_env: Mapping[str, str],
    stdin: bytes,
    cni_path: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT,
) -> Result:
    data = exec_plugin(plugin_type, "ADD", cni_env, stdin, cni_path, timeout)
    if data is None:
        raise CniError(DELEGATE, details=f"IPAM plugin {plugin_type!r} ADD printed no result")
    try:
        return Result.from_dict(data, f"{plugin_type} result")
    except CniError as e:
        raise CniError(DELEGATE, details=e.details) from None
