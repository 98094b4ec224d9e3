"""Running external commands (mkfs, losetup, mount, btrfs, nft, health checks).

Always an argument list, never a shell; always a timeout; a failure raises :class:`CommandError`, whose message
names the command, its exit status and its stderr, so it can go straight into a gRPC status or a CNI error.

``asyncio`` is imported by :func:`arun` only: the standalone CNI entry point runs ``nft`` through :func:`run` (for
``ipMasq``), and importing asyncio would cost it more than the command.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

DEFAULT_TIMEOUT = 60.0


class CommandError(Exception):
    """An external command failed, timed out, or was not found."""

    def __init__(self, argv: Sequence[str], detail: str, returncode: int | None = None, stderr: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.detail = detail
        super().__init__(f"command {' '.join(self.argv)!r} {detail}" + (f": {self.stderr}" if self.stderr else ""))


def run(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT, input: bytes | None = None) -> str:
    """Run ``argv``, return its stdout as text; raise :class:`CommandError` on any failure."""
    try:
        proc = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            timeout=timeout,
            check=False,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise CommandError(argv, "not found on PATH: install it on the node") from None
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if e.stderr else ""
        raise CommandError(argv, f"timed out after {timeout:g}s", None, err) from None
    if proc.returncode != 0:
        raise CommandError(
            argv, f"exited with status {proc.returncode}", proc.returncode, proc.stderr.decode(errors="replace")
        )
    return proc.stdout.decode(errors="replace")


async def arun(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT) -> str:
    """Async twin of :func:`run` for use inside the event loop; the child is killed on timeout or cancel."""
    import asyncio

    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except FileNotFoundError:
        raise CommandError(argv, "not found on PATH: install it on the node") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError) as e:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        if isinstance(e, asyncio.CancelledError):
            raise
        raise CommandError(argv, f"timed out after {timeout:g}s") from None
    if proc.returncode != 0:
        raise CommandError(argv, f"exited with status {proc.returncode}", proc.returncode, err.decode(errors="replace"))
    return out.decode(errors="replace")
