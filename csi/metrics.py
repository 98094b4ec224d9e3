"""The CSI driver's Prometheus metrics: how full this node's volumes and the filesystems under them are.

- ``nodeplug_csi_backend_size_bytes{backend}``, ``nodeplug_csi_backend_available_bytes{backend}``: the filesystem a
  backend keeps its volumes on (statvfs of its base directory: its size, and what unprivileged writers may still
  take). Loop files are sparse, so a backend that fills up fails writes inside volumes that still look half empty
  (I/O errors in the pods): the first thing to watch.
- ``nodeplug_csi_volume_size_bytes{volume_id}``, ``nodeplug_csi_volume_available_bytes{volume_id}``: every
  filesystem volume staged and mounted on this node, as ``df`` in the pod sees it (a btrfs subvolume: its qgroup
  limit and what is left under it). Block volumes have no filesystem to measure.
- ``nodeplug_csi_volumes{backend}``: volumes recorded on this node.

:class:`Sampler` measures every :data:`SAMPLE_SECONDS` on a worker thread, so a statvfs that hangs (a dead
filesystem) never holds up a scrape or the event loop; the collector reads the last sample.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from csi import mounts, nodestats
from csi.volumes import VolumeManager
from nodeplug.log import Logger

SAMPLE_SECONDS = 30.0


@dataclass(frozen=True)
class Sample:
    backends: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (size, available) bytes
    volumes: dict[str, tuple[int, int]] = field(default_factory=dict)  # volume_id -> (size, available) bytes
    counts: dict[str, int] = field(default_factory=dict)  # backend -> volumes recorded


def measure(manager: VolumeManager) -> Sample:
    """One sample of the backends and of every mounted filesystem volume (blocking: call it off the loop)."""
    backends: dict[str, tuple[int, int]] = {}
    for name, be in manager.backends.items():
        with contextlib.suppress(OSError):
            st = mounts.fs_stats(be.base)
            backends[name] = (st.total_bytes, st.available_bytes)
    volumes: dict[str, tuple[int, int]] = {}
    counts = dict.fromkeys(manager.backends, 0)
    for recorded in manager.store.list_volumes()[0]:
        counts[recorded.backend] = counts.get(recorded.backend, 0) + 1
    table = mounts.mount_table()
    for rec in manager.store.list_stages():
        v = manager.store.get_volume(rec.volume_id)
        if v is None or v.is_block or not mounts.is_mounted(rec.staging_path, table):
            continue
        try:
            fs = mounts.fs_stats(Path(rec.staging_path))
        except OSError:
            continue  # a filesystem that fails statvfs is reported by NodeGetVolumeStats' condition
        if v.is_subvolume:
            fs = nodestats.subvolume_usage(v, Path(v.path), fs)
        volumes[v.volume_id] = (fs.total_bytes, fs.available_bytes)
    return Sample(backends, volumes, counts)


class Sampler:
    """Measures in the background and serves the last :class:`Sample` to the agent's registry."""

    def __init__(self, manager: VolumeManager, registry: CollectorRegistry, log: Logger) -> None:
        self.manager = manager
        self.registry = registry
        self.log = log
        self.sample = Sample()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.registry.register(self)
        self._task = asyncio.create_task(self._loop(), name="csi-metrics")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.registry.unregister(self)

    async def _loop(self) -> None:
        while True:
            try:
                self.sample = await asyncio.to_thread(measure, self.manager)
            except Exception as e:  # a broken sample must not end the sampling
                self.log.warning("volume usage not measured", error=str(e) or repr(e))
            await asyncio.sleep(SAMPLE_SECONDS)

    def collect(self) -> Iterator[Metric]:
        s = self.sample
        bsize = GaugeMetricFamily(
            "nodeplug_csi_backend_size_bytes", "Size of the filesystem a volume backend lives on.", labels=["backend"]
        )
        bavail = GaugeMetricFamily(
            "nodeplug_csi_backend_available_bytes",
            "Bytes still free on the filesystem a volume backend lives on (sparse loop files grow into it).",
            labels=["backend"],
        )
        for name, (size, avail) in sorted(s.backends.items()):
            bsize.add_metric([name], size)
            bavail.add_metric([name], avail)
        vsize = GaugeMetricFamily(
            "nodeplug_csi_volume_size_bytes", "Size of a mounted filesystem volume on this node.", labels=["volume_id"]
        )
        vavail = GaugeMetricFamily(
            "nodeplug_csi_volume_available_bytes",
            "Bytes still free in a mounted filesystem volume on this node.",
            labels=["volume_id"],
        )
        for vid, (size, avail) in sorted(s.volumes.items()):
            vsize.add_metric([vid], size)
            vavail.add_metric([vid], avail)
        count = GaugeMetricFamily(
            "nodeplug_csi_volumes", "Volumes recorded on this node, by backend.", labels=["backend"]
        )
        for name, n in sorted(s.counts.items()):
            count.add_metric([name], n)
        yield from (bsize, bavail, vsize, vavail, count)

    def describe(self) -> Iterator[Metric]:
        return iter(())
