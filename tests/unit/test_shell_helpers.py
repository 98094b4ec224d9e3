"""Logging format, external commands, host paths."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeplug import log
from nodeplug.commands import CommandError, arun, run
from nodeplug.fsutil import write_atomic
from nodeplug.paths import Root


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """log.setup() configures the process-wide ``nodeplug`` logger: put it back for the tests that follow."""
    logger = logging.getLogger("nodeplug")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_logfmt_line_carries_plugin_and_fields() -> None:
    buf = io.StringIO()
    log.setup("debug", buf)
    log.get_logger("csi").bind(rpc="/csi.v1.Node/NodeStageVolume").info("volume staged", volume_id="vol-1", note="a b")
    line = buf.getvalue().strip()
    assert line.startswith("ts=")
    assert ' level=info plugin=csi msg="volume staged" rpc=/csi.v1.Node/NodeStageVolume volume_id=vol-1' in line
    assert line.endswith('note="a b"')


def test_debug_lines_are_dropped_at_info() -> None:
    buf = io.StringIO()
    log.setup("info", buf)
    log.get_logger("csi").debug("probe")
    assert buf.getvalue() == ""


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


def test_root_places_paths_under_it(tmp_path: Path) -> None:
    assert Root()("/run/nodeplug") == Path("/run/nodeplug")
    assert Root(tmp_path)("/run/nodeplug/cni.sock") == tmp_path / "run/nodeplug/cni.sock"
    with pytest.raises(ValueError, match="absolute"):
        Root(tmp_path)("run")


def test_write_atomic_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "10-net.conflist"
    target.write_bytes(b"old")
    write_atomic(target, b"new content", mode=0o640)
    assert target.read_bytes() == b"new content"
    assert (target.stat().st_mode & 0o777) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["10-net.conflist"]


def test_write_atomic_failure_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "spec.json"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]
