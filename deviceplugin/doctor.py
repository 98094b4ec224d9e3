"""``nodeplug doctor`` checks for the device plugin, run in a separate process beside a possibly running agent.

For the node: the host root's ``/dev`` and ``/sys`` are readable, inotify and kernel uevents work, each health/reset
command is on PATH, and what discovery finds for each resource right now. For a running agent, acting as kubelet
does through each resource's socket: GetDevicePluginOptions, the first ListAndWatch answer (device count by health),
whether kubelet lists the resource as allocatable (pod-resources API, when kubelet serves it), and an Allocate round
trip for one healthy device (Allocate holds no state in this plugin, so the check changes nothing). No socket: the
agent is not running, and those checks are skipped.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from deviceplugin import discovery
from deviceplugin.config import Config, Resource
from deviceplugin.inotify import Inotify
from deviceplugin.uevent import UeventMonitor
from nodeplug.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from nodeplug.api.podresources.v1 import api_pb2 as pr_pb2
from nodeplug.api.podresources.v1 import api_pb2_grpc as pr_grpc
from nodeplug.checks import Check, CheckFailed, CheckSkipped, dirs_check
from nodeplug.paths import DEVICE_PLUGIN_DIR, KUBELET_DIR, KUBELET_SOCKET
from nodeplug.plugin import AgentContext

TIMEOUT = 5.0
POD_RESOURCES_SOCKET = KUBELET_DIR + "/pod-resources/kubelet.sock"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _host_root(section: Config) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        for sub in ("dev", "sys"):
            p = os.path.join(section.host_root, sub)
            if not os.access(p, os.R_OK | os.X_OK):
                raise CheckFailed(f"{p} is not readable: mount the host's /{sub} there or set deviceplugin.host_root")
        return f"{section.host_root} has dev and sys"

    return run


def _change_detection() -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        try:
            Inotify(lambda *_: None).close()
        except OSError as e:
            raise CheckFailed(
                f"inotify is not available ({e}): device hotplug would only be seen by the re-scan"
            ) from None
        try:
            UeventMonitor(lambda *_: None).close()
        except OSError as e:
            return f"inotify ok; no kernel uevents ({e.strerror}): PCI/USB hotplug is seen by the safety re-scan"
        return "inotify and kernel uevents"

    return run


def _tools(section: Config) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        argv0 = sorted(
            {c.command[0] for r in section.resources for c in (r.health, r.reset) if c is not None and c.command}
        )
        if not argv0:
            raise CheckSkipped("no health or reset commands configured")
        missing = [a for a in argv0 if shutil.which(a) is None]
        if missing:
            raise CheckFailed(f"not found on PATH: {', '.join(missing)}")
        return ", ".join(argv0)

    return run


def _discovered(section: Config, res: Resource) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        # a thread: a slow sysfs walk must not stall the loop, and the doctor's per-check timeout must still apply
        found = await asyncio.to_thread(discovery.discover, res, section.host_root)
        missing = [d for d in found.devices if d.missing]
        detail = _count(len(found.devices), "device") + (f" x {res.replicas} replicas" if res.replicas > 1 else "")
        if found.problems:
            detail += "; " + "; ".join(found.problems)
        if missing:
            raise CheckFailed(
                detail + "; missing nodes: " + ", ".join(f"{d.id} ({', '.join(d.missing)})" for d in missing)
            )
        return detail

    return run


def socket_path(ctx: AgentContext, res: Resource) -> Path:
    return ctx.root(DEVICE_PLUGIN_DIR) / res.socket_name


def _channel(ctx: AgentContext, res: Resource) -> grpc.aio.Channel:
    sock = socket_path(ctx, res)
    if not sock.exists():
        raise CheckSkipped(f"{sock} does not exist: the agent is not running")
    return grpc.aio.insecure_channel(f"unix://{sock}")


async def _first_listing(stub: api_pb2_grpc.DevicePluginAsyncStub) -> api_pb2.ListAndWatchResponse:
    call = stub.ListAndWatch(api_pb2.Empty(), timeout=TIMEOUT)
    try:
        async for msg in call:
            first: api_pb2.ListAndWatchResponse = msg
            return first
    finally:
        call.cancel()
    raise CheckFailed("ListAndWatch ended without a listing")


async def _kubelet_count(ctx: AgentContext, res: Resource) -> int | None:
    sock = ctx.root(POD_RESOURCES_SOCKET)
    if not sock.exists():
        return None
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        resp = await pr_grpc.PodResourcesListerStub(ch).GetAllocatableResources(
            pr_pb2.AllocatableResourcesRequest(), timeout=TIMEOUT
        )
    return sum(len(d.device_ids) for d in resp.devices if d.resource_name == res.resource_name)


def _serving(ctx: AgentContext, res: Resource) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        async with _channel(ctx, res) as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            try:
                await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=TIMEOUT)
                listing = await _first_listing(stub)
            except grpc.aio.AioRpcError as e:
                raise CheckFailed(f"{res.socket_name} does not answer: {e.code().name}: {e.details()}") from None
        healthy = sum(1 for d in listing.devices if d.health == "Healthy")
        detail = f"serving {_count(len(listing.devices), 'device')} ({healthy} healthy)"
        try:
            allocatable = await _kubelet_count(ctx, res)
        except grpc.aio.AioRpcError as e:
            return detail + f"; kubelet pod-resources API: {e.code().name}"
        if allocatable is None:
            kubelet_sock = ctx.root(KUBELET_SOCKET)
            return detail + ("; kubelet.sock present" if kubelet_sock.exists() else "; kubelet.sock missing")
        if allocatable == 0 and healthy:
            raise CheckFailed(detail + f"; kubelet lists no {res.resource_name} devices: not registered")
        return detail + f"; registered, kubelet lists {allocatable} allocatable"

    return run


def _allocate(ctx: AgentContext, res: Resource) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        async with _channel(ctx, res) as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            try:
                listing = await _first_listing(stub)
                ids = [d.ID for d in listing.devices if d.health == "Healthy"]
                if not ids:
                    raise CheckSkipped("no healthy device to allocate")
                req = api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids[:1])]
                )
                resp = await stub.Allocate(req, timeout=TIMEOUT)
            except grpc.aio.AioRpcError as e:
                raise CheckFailed(f"Allocate failed: {e.code().name}: {e.details()}") from None
        if len(resp.container_responses) != 1:
            raise CheckFailed(f"Allocate answered {len(resp.container_responses)} containers for 1")
        c = resp.container_responses[0]
        if not (c.devices or c.cdi_devices):
            raise CheckFailed(f"Allocate of {ids[0]} gave no device nodes and no CDI devices")
        what = [d.host_path for d in c.devices] or [d.name for d in c.cdi_devices]
        return f"{ids[0]} -> {', '.join(what)}"

    return run


def checks(section: Config, ctx: AgentContext) -> list[Check]:
    out = [
        dirs_check("kubelet", "device-plugins directory", [ctx.root(DEVICE_PLUGIN_DIR)], ctx.root.path),
        Check("deviceplugin", "host root", _host_root(section)),
        Check("deviceplugin", "change detection", _change_detection()),
        Check("tools", "deviceplugin health/reset commands", _tools(section)),
    ]
    for res in section.resources:
        out.append(Check("deviceplugin", f"{res.name} discovery", _discovered(section, res)))
        out.append(Check("deviceplugin", f"{res.name} serving", _serving(ctx, res)))
        out.append(Check("deviceplugin", f"{res.name} allocate", _allocate(ctx, res)))
    return out
