"""Health and reset commands: a resource's configured argv, filled in per device, run with a timeout.

``{id}``, ``{path}`` and ``{address}`` are replaced in every argument (no shell is involved, so a value never splits
or expands). The commands run in the agent, so ``{path}`` is the device's first node as the agent sees it: under
``host_root`` (``/host/dev/ttyUSB0`` in a DaemonSet that mounts the host at ``/host``). A health command passes with
exit status 0; anything else, a timeout included, makes the device unhealthy with the command's error as the reason,
until a later run passes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from deviceplugin.config import HealthSpec, ResetSpec
from deviceplugin.discovery import Device
from nodeplug.commands import CommandError, arun

MAX_PARALLEL = 8


def fill(argv: Sequence[str], dev: Device, host_root: str = "/") -> list[str]:
    path = os.path.join(host_root, dev.path.lstrip("/")) if dev.path and host_root != "/" else dev.path
    values = {"id": dev.id, "path": path, "address": dev.address}
    return [a.format(**values) for a in argv]


async def check(spec: HealthSpec, dev: Device, host_root: str = "/") -> str | None:
    """None when the device's health command passes, else why it failed."""
    try:
        await _run(fill(spec.command, dev, host_root), spec.timeout_seconds)
    except CommandError as e:
        return f"health {e}"
    return None


async def check_all(spec: HealthSpec, devices: Sequence[Device], host_root: str = "/") -> dict[str, str | None]:
    """Run the health command for every device, at most :data:`MAX_PARALLEL` at a time."""
    sem = asyncio.Semaphore(MAX_PARALLEL)

    async def one(dev: Device) -> tuple[str, str | None]:
        async with sem:
            return dev.id, await check(spec, dev, host_root)

    results = await asyncio.gather(*(one(d) for d in devices))
    return dict(results)


async def reset(spec: ResetSpec, devices: Sequence[Device], host_root: str = "/") -> None:
    """Run the reset command for each device in turn; raise :class:`CommandError` on the first failure."""
    for dev in devices:
        await _run(fill(spec.command, dev, host_root), spec.timeout_seconds)


async def _run(argv: list[str], timeout: float) -> None:
    try:
        await arun(argv, timeout=timeout)
    except OSError as e:  # not executable, permission denied: a CommandError like any other failure
        raise CommandError(argv, f"could not be started ({e.strerror})") from None
