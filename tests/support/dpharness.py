"""The device plugin under a kubelet stand-in, as a pytest plugin (registered in tests/conftest.py).

The ``dp`` fixture gives a :class:`Harness`: the plugin on a temporary agent root, a
:class:`~lab.kubelet.FakeKubelet` on that root's ``kubelet.sock`` (v1beta1 Registration from the generated stubs),
and a :class:`~lab.devicehost.FakeHost` (device nodes made with mknod as root, plain files otherwise; a fake sysfs
for PCI, USB and NUMA). After the test the plugin and the stand-in stop, and no asyncio task of theirs may be left.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config import Config
from deviceplugin.plugin import DevicePlugin
from nodeplug.paths import CDI_DIR, DEVICE_PLUGIN_DIR, Root
from nodeplug.plugin import AgentContext

from lab.devicehost import FakeHost, short_tempdir
from lab.kubelet import Endpoint, FakeKubelet, Listing


class Harness:
    """The plugin on a temporary agent root, a kubelet stand-in on its kubelet.sock, and a fake host."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.fake = FakeHost(base / "host")
        self.host = self.fake.root
        self.ctx = AgentContext(root=Root(base / "root"))
        self.plugin_dir = self.ctx.root(DEVICE_PLUGIN_DIR)
        self.cdi_dir = self.ctx.root(CDI_DIR)
        self.kubelet = FakeKubelet(self.plugin_dir)
        self.plugin: DevicePlugin | None = None

    def mknod(self, host_path: str) -> Path:
        return self.fake.node(host_path)

    def config(self, resources: list[dict[str, Any]], **kw: Any) -> Config:
        return Config.model_validate({"host_root": str(self.host), "resources": resources, **kw})

    async def start(self, cfg: Config, kubelet: bool = True) -> DevicePlugin:
        if kubelet:
            await self.kubelet.start()
        self.plugin = DevicePlugin(cfg, self.ctx)
        await self.plugin.start()
        return self.plugin

    async def ep(self, name: str, after: int = 0) -> Endpoint:
        return await self.kubelet.wait_registered(f"nodeplug.io/{name}", after=after)

    async def close(self) -> None:
        try:
            if self.plugin is not None:
                await self.plugin.stop(0)
            await self.kubelet.stop()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


@contextlib.asynccontextmanager
async def harness() -> AsyncIterator[Harness]:
    """A :class:`Harness` in a fresh :func:`short_tempdir`, closed on exit; then no task of it may be left."""
    h = Harness(short_tempdir())
    try:
        yield h
    finally:
        await h.close()
    await assert_no_tasks_left()


@pytest.fixture
async def dp() -> AsyncIterator[Harness]:
    async with harness() as h:
        yield h


def ids(listing: Listing) -> list[str]:
    return [d[0] for d in listing]


def health(listing: Listing) -> dict[str, str]:
    return {d[0]: d[1] for d in listing}


async def assert_no_tasks_left(grace: float = 2.0) -> None:
    """Fail if a task outlives the plugin; tasks that are merely finishing (a closed gRPC call delivering its final
    status) get ``grace`` seconds to end first, while a leaked loop never would."""
    current = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not current]
    if pending:
        _done, still = await asyncio.wait(pending, timeout=grace)
        assert not still, f"tasks left behind: {sorted(still, key=id)}"
