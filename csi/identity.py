"""The CSI Identity service: who the driver is, what it can do, and whether it is healthy.

Probe answers ``ready: true`` when the state store answers a query (the one thing every other RPC needs), ``ready:
false`` before the plugin has opened it, and FAILED_PRECONDITION naming the problem when the store is broken (the
spec's "plugin is unhealthy"), so the CO's liveness probe restarts the agent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from google.protobuf import wrappers_pb2

from csi.errors import FailedPrecondition
from csi.grpcerrors import Context, rpc
from nodeplug import __version__
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc

# Returns False while the plugin is starting; raises (any exception, its text is the reason) when unhealthy.
ProbeFn = Callable[[], Awaitable[bool]]

_Service = csi_pb2.PluginCapability.Service
_Expansion = csi_pb2.PluginCapability.VolumeExpansion


def plugin_capabilities() -> list[csi_pb2.PluginCapability]:
    return [
        csi_pb2.PluginCapability(service=_Service(type=_Service.CONTROLLER_SERVICE)),
        csi_pb2.PluginCapability(service=_Service(type=_Service.VOLUME_ACCESSIBILITY_CONSTRAINTS)),
        csi_pb2.PluginCapability(service=_Service(type=_Service.GROUP_CONTROLLER_SERVICE)),
        csi_pb2.PluginCapability(volume_expansion=_Expansion(type=_Expansion.ONLINE)),
    ]


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, driver_name: str, probe: ProbeFn, vendor_version: str = __version__) -> None:
        self.driver_name = driver_name
        self.vendor_version = vendor_version
        self._probe = probe

    @rpc
    async def GetPluginInfo(
        self, request: csi_pb2.GetPluginInfoRequest, context: Context
    ) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=self.driver_name, vendor_version=self.vendor_version)

    @rpc
    async def GetPluginCapabilities(
        self, request: csi_pb2.GetPluginCapabilitiesRequest, context: Context
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=plugin_capabilities())

    @rpc
    async def Probe(self, request: csi_pb2.ProbeRequest, context: Context) -> csi_pb2.ProbeResponse:
        try:
            ready = await self._probe()
        except Exception as e:
            raise FailedPrecondition(f"plugin is unhealthy: {e}") from e
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=ready))
