"""Health and reset commands: placeholders, pass/fail/timeout, a command that cannot start."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.config import HealthSpec, ResetSpec
from deviceplugin.discovery import Device, DeviceNode
from deviceplugin.health import check, check_all, fill, reset
from nodeplug.commands import CommandError

DEV = Device("0000:3b:00.0", (DeviceNode("/dev/vfio/40", "/dev/vfio/40"),), 0, "0000:3b:00.0")


def test_fill_replaces_placeholders_without_splitting() -> None:
    argv = fill(["check", "--dev={path}", "{id}", "addr {address}"], DEV)
    assert argv == ["check", "--dev=/dev/vfio/40", "0000:3b:00.0", "addr 0000:3b:00.0"]
    assert fill(["check", "{path}"], DEV, "/host") == ["check", "/host/dev/vfio/40"]  # as the agent sees it


async def test_check_pass_fail_timeout_and_not_startable(tmp_path: Path) -> None:
    assert await check(HealthSpec(command=["true"]), DEV) is None
    assert await check(HealthSpec(command=["false"]), DEV) == "health command 'false' exited with status 1"
    slow = await check(HealthSpec(command=["sleep", "5"], timeout_seconds=0.1), DEV)
    assert slow == "health command 'sleep 5' timed out after 0.1s"
    plain = tmp_path / "not-executable"
    plain.write_text("")
    assert await check(HealthSpec(command=[str(plain)]), DEV) == (
        f"health command '{plain}' could not be started (Permission denied)"
    )
    missing = await check(HealthSpec(command=["/nonexistent/check"]), DEV)
    assert missing is not None and "not found on PATH" in missing


async def test_check_all_runs_per_device() -> None:
    other = Device("b", (DeviceNode("/dev/b", "/dev/b"),))
    got = await check_all(HealthSpec(command=["test", "{id}", "=", "b"]), [DEV, other])
    assert got == {"0000:3b:00.0": "health command 'test 0000:3b:00.0 = b' exited with status 1", "b": None}


async def test_reset_runs_per_device_and_raises_on_failure(tmp_path: Path) -> None:
    await reset(ResetSpec(command=["touch", str(tmp_path / "{id}")]), [DEV])
    assert (tmp_path / "0000:3b:00.0").exists()
    with pytest.raises(CommandError, match="'false' exited with status 1"):
        await reset(ResetSpec(command=["false"]), [DEV])
