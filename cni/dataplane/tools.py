"""External commands of the dataplane (``nft``, ``bridge``), run through :func:`nodeplug.commands.run`.

``nodeplug.commands`` is imported on first use: importing the ``nodeplug`` package costs about 15 ms, which a
standalone CNI call that never runs a command (no ``ipMasq``, no ``vlan``) should not pay. Failures come back as
:class:`ToolError`, carrying the command's message (naming the command and its stderr), whether it is missing and
whether it timed out (a loaded node: :meth:`ToolError.cni_error` makes that code 11, try again later).
:func:`nft_if_there` runs ``nft`` on a table or set that may not exist, which is no failure.
"""

from __future__ import annotations

from collections.abc import Sequence

from cni.errors import DATAPLANE, TRY_AGAIN_LATER, CniError


class ToolError(Exception):
    def __init__(self, message: str, stderr: str, missing: bool, timed_out: bool = False) -> None:
        super().__init__(message)
        self.stderr = stderr
        self.missing = missing  # the command is not installed
        self.timed_out = timed_out  # it did not finish in time (the node is loaded): worth trying again later

    def cni_error(self, what: str) -> CniError:
        """The CNI error for this failure: code 11 (try again later) when it timed out, else 101."""
        return CniError(TRY_AGAIN_LATER if self.timed_out else DATAPLANE, details=f"{what}: {self}")


def run_tool(argv: Sequence[str], timeout: float, input: bytes | None = None) -> str:
    """Run ``argv`` (argument list, no shell) and return its stdout; :class:`ToolError` on any failure."""
    from nodeplug.commands import CommandError, run

    try:
        return run(argv, timeout=timeout, input=input)
    except CommandError as e:
        not_run = e.returncode is None
        missing, timed_out = not_run and "not found" in e.detail, not_run and "timed out" in e.detail
        raise ToolError(str(e), e.stderr, missing, timed_out) from None


def nft_if_there(args: Sequence[str], timeout: float) -> str | None:
    """Run ``nft args`` on a table or set that may not be there: its stdout, or None when it is not there (nor is
    ``nft`` installed: then nothing made it). :class:`ToolError` on any other failure."""
    try:
        return run_tool(["nft", *args], timeout=timeout)
    except ToolError as e:
        if e.missing or "No such file or directory" in e.stderr:
            return None
        raise
