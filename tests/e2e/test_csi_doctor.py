"""``nodeplug doctor``'s CSI checks against a running driver (and a stopped one)."""

from __future__ import annotations

import os

import pytest

from csi.config import Config
from csi.doctor import checks
from nodeplug.checks import CheckSkipped
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

from support.csidriver import running_driver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates loop devices and mounts")


async def test_doctor_runs_a_whole_lifecycle_through_the_socket() -> None:
    config = Config()
    async with running_driver(config) as d:
        ctx = AgentContext(root=Root(d.root))
        by_name = {c.name: c for c in checks(config, ctx)}
        assert set(by_name) >= {"loop devices", "mkfs.ext4", "mkfs.xfs", "btrfs backend", "volume lifecycle"}
        assert "next free loop device /dev/loop" in await by_name["loop devices"].run()
        assert (await by_name["mkfs.ext4"].run()).endswith("mkfs.ext4")
        with pytest.raises(CheckSkipped, match="not enabled"):
            await by_name["btrfs backend"].run()
        assert "reg.sock" in await by_name["registration socket"].run()
        detail = await by_name["volume lifecycle"].run()
        assert "wrote and read back" in detail
        # it left nothing behind: no volume, no mount, no loop device, no work directory
        assert d.plugin is not None and d.plugin.store is not None
        assert d.plugin.store.list_volumes()[0] == []
        assert d.mounts_under_root() == [] and d.loops_under_root() == []
        plugin_dir = d.root / "var/lib/kubelet/plugins/local.csi.nodeplug.io"
        assert sorted(p.name for p in plugin_dir.iterdir()) == ["csi.sock"]
        assert sorted(p.name for p in d.kubelet.iterdir()) == ["plugins", "plugins_registry"]  # no pods/, no staging
        assert sorted(p.name for p in (d.kubelet / "plugins").iterdir()) == ["local.csi.nodeplug.io"]

        await d.stop()
        with pytest.raises(CheckSkipped, match="not running"):
            await by_name["volume lifecycle"].run()
