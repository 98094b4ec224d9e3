"""Prometheus metrics for one agent.

Each agent owns a :class:`Metrics` with its own registry (tests run several agents in one process). The gRPC helper
records every RPC in ``nodeplug_rpc_total`` and ``nodeplug_rpc_duration_seconds`` by plugin, method and status code;
the agent adds ``nodeplug_plugin_ready{plugin}`` (:class:`ReadinessCollector`: 1 while the plugin's ``/readyz`` line
says ready, read at scrape time); plugins add their own collectors to :attr:`Metrics.registry`. The alerts and
recording rules over all of them are in ``daemonset/monitoring/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

RPC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rpc_total = Counter(
            "nodeplug_rpc",
            "RPCs served, by plugin, method and gRPC status code.",
            ["plugin", "method", "code"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            "nodeplug_rpc_duration_seconds",
            "RPC latency in seconds, by plugin, method and gRPC status code.",
            ["plugin", "method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )

    def observe_rpc(self, plugin: str, method: str, code: str, seconds: float) -> None:
        self.rpc_total.labels(plugin, method, code).inc()
        self.rpc_seconds.labels(plugin, method, code).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector in this agent's registry."""
        return generate_latest(self.registry)


class ReadinessCollector:
    """``nodeplug_plugin_ready{plugin}``: 1 while a running plugin is ready, 0 while it is not, from ``ready()``
    (plugin name -> ready) at scrape time; a plugin that is not running has no series."""

    def __init__(self, ready: Callable[[], Mapping[str, bool]]) -> None:
        self._ready = ready

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "nodeplug_plugin_ready", "1 while the plugin is ready (its line in /readyz), by plugin.", labels=["plugin"]
        )
        for name, ready in sorted(self._ready().items()):
            g.add_metric([name], 1 if ready else 0)
        yield g

    def describe(self) -> Iterator[Metric]:
        return iter(())
