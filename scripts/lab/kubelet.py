"""A stand-in for kubelet's device manager, for the device-plugin tests and the benchmark: the ``Registration``
service on ``kubelet.sock``.

A registering plugin is dialled at ``<plugin dir>/<endpoint>``: the stand-in reads ``GetDevicePluginOptions`` and
keeps a ``ListAndWatch`` stream open, recording every listing it receives (and when). Tests then call Allocate /
GetPreferredAllocation / PreStartContainer through the endpoint's ``stub``. :meth:`FakeKubelet.restart` stops,
wipes the directory and serves a new ``kubelet.sock``, as a kubelet restart does. Waiting is event-driven: every
registration, listing and stream end wakes the waiters.

It does not re-code kubelet's checks of a registration (version, resource name, endpoint): that registration,
re-registration after a kubelet restart, and devices kept by running pods are proven against the real kubelet in
the cluster tier (tests/cluster/test_kubelet_restart.py). It stays for what a real kubelet cannot be made to do:

- run on a temporary agent root, many at once, in milliseconds, beside whatever else runs on the machine (a real
  kubelet owns the node's paths and cgroups: one per machine, minutes to bring up);
- refuse registrations on demand (:attr:`FakeKubelet.reject`), be absent when the plugin starts and appear at a
  chosen moment, lose its whole directory;
- hand over every listing it received, with its arrival time (each health change asserted; hotplug latency in
  scripts/bench-deviceplugin), and call the plugin's RPCs with any request, hostile ones included.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio

from nodeplug.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

Listing = list[tuple[str, str, tuple[int, ...]]]  # (ID, health, NUMA nodes) per device, as received
Context = aio.ServicerContext[api_pb2.RegisterRequest, api_pb2.Empty]


class Changes:
    """Wakes every waiter when something changed; waiters re-check their condition (no polling)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def until(self, ready: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what()} within {timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), left)


@dataclass
class Endpoint:
    """One registered resource as the stand-in sees it."""

    request: api_pb2.RegisterRequest
    channel: aio.Channel
    stub: api_pb2_grpc.DevicePluginAsyncStub
    options: api_pb2.DevicePluginOptions | None = None
    listings: list[Listing] = field(default_factory=list)
    listing_times: list[float] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    changes: Changes = field(default_factory=Changes)
    stream_ended: bool = False

    @property
    def latest(self) -> Listing:
        return self.listings[-1] if self.listings else []

    async def wait_listing(self, pred: Callable[[Listing], bool], timeout: float = 5.0) -> Listing:
        """Wait until the latest listing satisfies ``pred`` (called with the listing); return that listing."""
        await self.changes.until(
            lambda: bool(self.listings) and pred(self.latest), timeout, lambda: f"no matching listing; {self.latest}"
        )
        return self.latest


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    async def Register(self, request: api_pb2.RegisterRequest, context: Context) -> api_pb2.Empty:
        arrived = time.perf_counter()
        self.kubelet.attempts.append(request)
        self.kubelet.changes.notify()
        if self.kubelet.reject is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.kubelet.reject)
        await self.kubelet.connect(request, arrived)
        return api_pb2.Empty()


class FakeKubelet:
    def __init__(self, plugin_dir: Path, interceptors: Sequence[aio.ServerInterceptor] = ()) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.socket = self.plugin_dir / "kubelet.sock"
        self.interceptors = list(interceptors)
        self.attempts: list[api_pb2.RegisterRequest] = []  # every Register call, rejected ones too
        self.requests: list[api_pb2.RegisterRequest] = []  # the accepted ones
        self.request_times: list[float] = []  # when each of ``requests`` arrived
        self.endpoints: dict[str, Endpoint] = {}
        self.reject: str | None = None
        self.changes = Changes()
        self._server: aio.Server | None = None

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        server = aio.server(interceptors=self.interceptors)
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def stop(self, wipe: bool = False) -> None:
        for ep in self.endpoints.values():
            await self._drop(ep)
        self.endpoints.clear()
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        if wipe:
            for p in self.plugin_dir.iterdir():
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    p.unlink()

    async def restart(self) -> None:
        """Like a kubelet restart: streams closed, directory wiped, a new kubelet.sock."""
        await self.stop(wipe=True)
        await self.start()

    async def _drop(self, ep: Endpoint) -> None:
        if ep.task is not None:
            ep.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ep.task
        await ep.channel.close()

    async def connect(self, request: api_pb2.RegisterRequest, arrived: float) -> None:
        """Dial a registering plugin's endpoint, read its options and follow its ListAndWatch stream."""
        old = self.endpoints.pop(request.resource_name, None)
        if old is not None:
            await self._drop(old)
        channel = aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        ep = Endpoint(request=request, channel=channel, stub=api_pb2_grpc.DevicePluginStub(channel))
        ep.options = await ep.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
        ep.task = asyncio.create_task(self._watch(ep), name=f"kubelet-watch-{request.resource_name}")
        self.endpoints[request.resource_name] = ep
        self.requests.append(request)
        self.request_times.append(arrived)
        self.changes.notify()

    async def _watch(self, ep: Endpoint) -> None:
        try:
            async for resp in ep.stub.ListAndWatch(api_pb2.Empty()):
                ep.listings.append([(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in resp.devices])
                ep.listing_times.append(time.perf_counter())
                ep.changes.notify()
                self.changes.notify()
        except aio.AioRpcError:
            pass
        finally:
            ep.stream_ended = True
            ep.changes.notify()

    async def wait_registered(self, resource_name: str, timeout: float = 5.0, after: int = 0) -> Endpoint:
        """The endpoint of ``resource_name`` once it has registered more than ``after`` times in total and its first
        listing has arrived."""

        def ready() -> bool:
            ep = self.endpoints.get(resource_name)
            return ep is not None and self.count(resource_name) > after and bool(ep.listings)

        await self.changes.until(ready, timeout, lambda: f"{resource_name} did not register")
        return self.endpoints[resource_name]

    def count(self, resource_name: str) -> int:
        return sum(1 for r in self.requests if r.resource_name == resource_name)
