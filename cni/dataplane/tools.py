"""External commands of the dataplane (``nft``, ``bridge``), run through :func:`nodeplug.commands.run`.

``nodeplug.commands`` is imported on first use: importing the ``nodeplug`` package costs about 15 ms, which a
standalone CNI call that never runs a command (no ``ipMasq``, no ``vlan``) should not pay. Failures come back as
:class:`ToolError`, carrying the command's message (naming the command and its stderr) and whether it is missing.
"""

from __future__ import annotations

from collections.abc import Sequence


class ToolError(Exception):
    def __init__(self, message: str, stderr: str, missing: bool) -> None:
        super().__init__(message)
        self.stderr = stderr
        self.missing = missing  # the command is not installed


def run_tool(argv: Sequence[str], timeout: float, input: bytes | None = None) -> str:
    """Run ``argv`` (argument list, no shell) and return its stdout; :class:`ToolError` on any failure."""
    from nodeplug.commands import CommandError, run

    try:
        return run(argv, timeout=timeout, input=input)
    except CommandError as e:
        raise ToolError(str(e), e.stderr, e.returncode is None and "not found" in e.detail) from None
