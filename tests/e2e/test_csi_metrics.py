"""The CSI driver's fullness metrics, read from the agent's registry as Prometheus scrapes it: the backend's
filesystem as statvfs sees it, and a staged volume's filesystem as df in its pod would (the alerts in
daemonset/monitoring/ fire on these)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.csidriver import Driver, MiB
from support.wait import eventually

pytestmark = pytest.mark.e2e


def samples(driver: Driver) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert driver.plugin is not None
    text = driver.plugin.ctx.metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("nodeplug_csi_")
    }


async def test_backend_and_staged_volume_fullness(csi_driver: Driver) -> None:
    vol = await csi_driver.create("fill-me", size=64 * MiB)
    staging = await csi_driver.stage(vol.volume_id)
    dd = ["dd", "if=/dev/zero", f"of={staging}/fill", "bs=1M", "count=40", "conv=fsync"]
    await asyncio.to_thread(subprocess.run, dd, check=True, capture_output=True, timeout=60)
    await csi_driver.restart()  # the driver measures when it starts, then every 30 s

    key = (("volume_id", vol.volume_id),)
    await eventually(lambda: ("nodeplug_csi_volume_size_bytes", key) in samples(csi_driver), 30, "the volume measured")
    got = samples(csi_driver)
    st = os.statvfs(staging)
    assert got[("nodeplug_csi_volume_size_bytes", key)] == st.f_blocks * st.f_frsize
    avail = got[("nodeplug_csi_volume_available_bytes", key)]
    assert avail < 64 * MiB - 40 * MiB and abs(avail - st.f_bavail * st.f_frsize) <= MiB
    assert got[("nodeplug_csi_volumes", (("backend", "loopfile"),))] == 1

    data = Path(csi_driver.root / "var/lib/nodeplug/csi")
    st = os.statvfs(data)
    backend = (("backend", "loopfile"),)
    assert got[("nodeplug_csi_backend_size_bytes", backend)] == st.f_blocks * st.f_frsize
    assert got[("nodeplug_csi_backend_available_bytes", backend)] > 0

    await csi_driver.unstage(vol.volume_id)
    await csi_driver.restart()
    await eventually(lambda: ("nodeplug_csi_volume_size_bytes", key) not in samples(csi_driver), 30,
                     "the unstaged volume no longer measured")  # fmt: skip
