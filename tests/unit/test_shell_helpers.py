"""Logging format, host paths, atomic writes (external commands: tests/integration/test_shell_commands.py)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeplug import log
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
