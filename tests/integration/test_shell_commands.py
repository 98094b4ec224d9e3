"""External commands: argument lists, the command and its stderr in every failure, timeouts that kill."""

from __future__ import annotations

import pytest

from nodeplug.commands import CommandError, arun, run


def test_run_returns_stdout() -> None:
    assert run(["echo", "hi"]) == "hi\n"


def test_run_failure_names_command_and_stderr() -> None:
    with pytest.raises(CommandError) as exc:
        run(["ls", "/definitely/not/here"])
    msg = str(exc.value)
    assert msg.startswith("command 'ls /definitely/not/here' exited with status 2: ")
    assert "No such file or directory" in msg


def test_run_missing_tool_and_timeout() -> None:
    with pytest.raises(CommandError, match="not found on PATH"):
        run(["no-such-tool-nodeplug"])
    with pytest.raises(CommandError, match=r"timed out after 0\.2s"):
        run(["sleep", "5"], timeout=0.2)


async def test_arun_kills_on_timeout() -> None:
    assert await arun(["echo", "x"]) == "x\n"
    with pytest.raises(CommandError, match=r"timed out after 0\.2s"):
        await arun(["sleep", "5"], timeout=0.2)
    with pytest.raises(CommandError, match="exited with status 1"):
        await arun(["false"])
