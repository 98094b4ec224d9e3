"""Prometheus metrics for one agent.

Each agent owns a :class:`Metrics` with its own registry (tests run several agents in one process). The gRPC helper
records every RPC in ``nodeplug_rpc_total`` and ``nodeplug_rpc_duration_seconds`` by plugin, method and status code;
plugins add their own collectors to :attr:`Metrics.registry`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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
