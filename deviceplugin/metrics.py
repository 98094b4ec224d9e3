"""The device plugin's Prometheus metrics, on the agent's registry.

- ``nodeplug_deviceplugin_devices{resource,health}``: listed device IDs (replicas counted) by health;
- ``nodeplug_deviceplugin_registered{resource}``: 1 while registered with kubelet;
- ``nodeplug_deviceplugin_streams{resource}``: open ListAndWatch streams;
- ``nodeplug_deviceplugin_allocations_total{resource}``: device IDs handed out by Allocate;
- ``nodeplug_deviceplugin_registrations_total{resource,result}``: Register calls to kubelet (ok / error);
- ``nodeplug_deviceplugin_allocate_duration_seconds{resource}``: Allocate latency;
- ``nodeplug_deviceplugin_scans_total{resource}``: discovery scans of the resource (its start, inotify and uevent
  re-scans, the safety timer): a count that climbs fast tells of a node busy with device events.

The gauges are read live from the running resources at scrape time; the collectors are added on start and
removed on stop, so an agent can start the plugin again on the same registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

ALLOCATE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 1.0)


@dataclass(frozen=True)
class ResourceStats:
    resource: str
    healthy: int
    unhealthy: int
    registered: bool
    streams: int


class _Live:
    def __init__(self, stats: Callable[[], Iterable[ResourceStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        devices = GaugeMetricFamily(
            "nodeplug_deviceplugin_devices", "Device IDs listed to kubelet, by resource and health.",
            labels=["resource", "health"],
        )  # fmt: skip
        registered = GaugeMetricFamily(
            "nodeplug_deviceplugin_registered", "1 while the resource is registered with kubelet.", labels=["resource"]
        )
        streams = GaugeMetricFamily(
            "nodeplug_deviceplugin_streams", "Open ListAndWatch streams, by resource.", labels=["resource"]
        )
        for s in self._stats():
            devices.add_metric([s.resource, "Healthy"], s.healthy)
            devices.add_metric([s.resource, "Unhealthy"], s.unhealthy)
            registered.add_metric([s.resource], 1 if s.registered else 0)
            streams.add_metric([s.resource], s.streams)
        yield devices
        yield registered
        yield streams

    def describe(self) -> Iterator[Metric]:
        return iter(())


class DevicePluginMetrics:
    def __init__(self, registry: CollectorRegistry, stats: Callable[[], Iterable[ResourceStats]]) -> None:
        self.registry = registry
        self._collectors: list[object] = []
        self.allocations = Counter(
            "nodeplug_deviceplugin_allocations", "Device IDs handed out by Allocate.", ["resource"], registry=None
        )
        self.registrations = Counter(
            "nodeplug_deviceplugin_registrations", "Register calls to kubelet, by result.", ["resource", "result"],
            registry=None,
        )  # fmt: skip
        self.allocate_seconds = Histogram(
            "nodeplug_deviceplugin_allocate_duration_seconds", "Allocate latency in seconds.", ["resource"],
            buckets=ALLOCATE_BUCKETS, registry=None,
        )  # fmt: skip
        self.scans = Counter(
            "nodeplug_deviceplugin_scans", "Discovery scans of a resource's devices.", ["resource"], registry=None
        )
        self._live = _Live(stats)

    def attach(self) -> None:
        for c in (self.allocations, self.registrations, self.allocate_seconds, self.scans, self._live):
            self.registry.register(c)
            self._collectors.append(c)

    def detach(self) -> None:
        for c in self._collectors:
            self.registry.unregister(c)  # type: ignore[arg-type]
        self._collectors.clear()
