"""The v1beta1 ``DevicePlugin`` service for one resource: validates, calls the core, maps errors in one place.

- GetDevicePluginOptions: ``pre_start_required`` when a reset command is set; GetPreferredAllocation always offered.
- ListAndWatch: the current listing, then every changed one, from the resource's :class:`Broadcast`; the stream
  ends when kubelet cancels it or the resource stops.
- GetPreferredAllocation / Allocate: :mod:`deviceplugin.policy` and :mod:`deviceplugin.cdi`; the whole request is
  checked before any answer, so an error never comes with a partial answer. A preference over thousands of IDs is
  computed off the event loop (the backend's :meth:`~Backend.offload`), on a snapshot of the device table.
- PreStartContainer: the reset command for each physical device among the IDs.

:func:`_status` is the one place a domain error becomes a gRPC status.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import NoReturn, ParamSpec, Protocol, TypeVar

import grpc

from deviceplugin.broadcast import Broadcast
from deviceplugin.cdi import ContainerEdits, container_edits
from deviceplugin.config import Resource
from deviceplugin.metrics import DevicePluginMetrics
from deviceplugin.policy import PolicyError, check_allocation, preferred
from deviceplugin.state import Listed, Snapshot, physical_id
from nodeplug.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from nodeplug.commands import CommandError

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


# The context of each method, typed by its request and response.
OptionsContext = grpc.aio.ServicerContext[api_pb2.Empty, api_pb2.DevicePluginOptions]
WatchContext = grpc.aio.ServicerContext[api_pb2.Empty, api_pb2.ListAndWatchResponse]
PreferContext = grpc.aio.ServicerContext[api_pb2.PreferredAllocationRequest, api_pb2.PreferredAllocationResponse]
AllocateContext = grpc.aio.ServicerContext[api_pb2.AllocateRequest, api_pb2.AllocateResponse]
PreStartContext = grpc.aio.ServicerContext[api_pb2.PreStartContainerRequest, api_pb2.PreStartContainerResponse]


class Backend(Protocol):
    res: Resource
    updates: Broadcast[api_pb2.ListAndWatchResponse]
    metrics: DevicePluginMetrics

    def lookup(self, replica_id: str) -> Listed | None: ...

    def snapshot(self) -> Snapshot: ...

    async def offload(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` off the event loop."""

    async def ensure_cdi_spec(self, ids: Iterable[str]) -> None:
        """The resource's CDI spec names ``ids`` once this returns (OSError when it cannot be written)."""

    async def reset(self, entries: list[Listed]) -> None: ...

    def allocated(self, entries: list[Listed]) -> None: ...


def listing_message(listing: tuple[Listed, ...]) -> api_pb2.ListAndWatchResponse:
    out = api_pb2.ListAndWatchResponse()
    for e in listing:
        d = out.devices.add(ID=e.id, health=e.health)
        if e.device.numa is not None:
            d.topology.nodes.add(ID=e.device.numa)
    return out


def edits_message(edits: ContainerEdits) -> api_pb2.ContainerAllocateResponse:
    out = api_pb2.ContainerAllocateResponse(envs=edits.envs)
    for m in edits.mounts:
        out.mounts.add(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
    for d in edits.devices:
        out.devices.add(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
    for name in edits.cdi_devices:
        out.cdi_devices.add(name=name)
    return out


async def _status(context: grpc.aio.ServicerContext[Req, Resp], e: Exception, where: str) -> NoReturn:
    if isinstance(e, PolicyError):
        code = grpc.StatusCode.INVALID_ARGUMENT if e.kind == "invalid" else grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(e, CommandError):
        code = grpc.StatusCode.INTERNAL
    elif isinstance(e, OSError):
        code = grpc.StatusCode.UNAVAILABLE
    else:
        code = grpc.StatusCode.INTERNAL
    await context.abort(code, f"{where}: {e}")
    raise AssertionError("abort returned")  # pragma: no cover


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, backend: Backend) -> None:
        self.b = backend

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: OptionsContext
    ) -> api_pb2.DevicePluginOptions:
        return options(self.b.res)

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: WatchContext
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        async with contextlib.aclosing(self.b.updates.subscribe()) as updates:
            async for msg in updates:
                yield msg

    async def GetPreferredAllocation(
        self,
        request: api_pb2.PreferredAllocationRequest,
        context: PreferContext,
    ) -> api_pb2.PreferredAllocationResponse:
        try:
            return await self.b.offload(preferences, request, self.b.snapshot(), self.b.res.allocation)
        except PolicyError as e:
            await _status(context, e, "GetPreferredAllocation")

    async def Allocate(
        self,
        request: api_pb2.AllocateRequest,
        context: AllocateContext,
    ) -> api_pb2.AllocateResponse:
        start = time.perf_counter()
        name = self.b.res.name
        try:
            if not request.container_requests:
                raise PolicyError("invalid", "no container_requests")
            chosen = each_container(
                request.container_requests, lambda c: check_allocation(c.devices_ids, self.b.lookup)
            )
            if self.b.res.cdi:
                await self.b.ensure_cdi_spec(e.id for entries in chosen for e in entries)
            out = api_pb2.AllocateResponse()
            for entries in chosen:
                out.container_responses.append(edits_message(container_edits(self.b.res, entries)))
        except (PolicyError, OSError) as e:
            await _status(context, e, "Allocate")
        finally:  # every answer, refusals included
            self.b.metrics.allocate_seconds.labels(name).observe(time.perf_counter() - start)
        self.b.metrics.allocations.labels(name).inc(sum(len(c) for c in chosen))
        self.b.allocated([e for entries in chosen for e in entries])
        return out

    async def PreStartContainer(
        self,
        request: api_pb2.PreStartContainerRequest,
        context: PreStartContext,
    ) -> api_pb2.PreStartContainerResponse:
        try:
            entries = [(i, self.b.lookup(i)) for i in request.devices_ids]
            unknown = [i for i, e in entries if e is None]
            if unknown:
                raise PolicyError("invalid", f"unknown device IDs: {', '.join(unknown)}")
            physical: dict[str, Listed] = {}
            for i, e in entries:
                if e is not None:
                    physical.setdefault(physical_id(i), e)
            await self.b.reset(list(physical.values()))
        except (PolicyError, CommandError) as e:
            await _status(context, e, "PreStartContainer")
        return api_pb2.PreStartContainerResponse()


def preferences(
    request: api_pb2.PreferredAllocationRequest, snap: Snapshot, mode: str
) -> api_pb2.PreferredAllocationResponse:
    """The answer for every container request, or a :class:`PolicyError` naming the first bad one."""
    answers = each_container(
        request.container_requests,
        lambda c: preferred(c.available_deviceIDs, c.must_include_deviceIDs, c.allocation_size, snap, mode),
    )
    out = api_pb2.PreferredAllocationResponse()
    for ids in answers:
        out.container_responses.add(deviceIDs=ids)
    return out


def each_container(requests: Iterable[R], fn: Callable[[R], T]) -> list[T]:
    """``fn`` for every container request, all of them before any answer; a :class:`PolicyError` names its request."""
    out = []
    for i, creq in enumerate(requests):
        try:
            out.append(fn(creq))
        except PolicyError as e:
            raise PolicyError(e.kind, f"container_requests[{i}]: {e}") from None
    return out


def options(res: Resource) -> api_pb2.DevicePluginOptions:
    return api_pb2.DevicePluginOptions(
        pre_start_required=res.reset is not None, get_preferred_allocation_available=True
    )
