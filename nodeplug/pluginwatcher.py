"""Registering a plugin with kubelet's plugin watcher (``pluginregistration`` v1), without a registrar sidecar.

kubelet watches ``/var/lib/kubelet/plugins_registry/`` for sockets. When one appears it dials it, calls ``GetInfo``
(type, name, endpoint, supported versions), validates the plugin through its own API at ``endpoint`` and then calls
``NotifyRegistrationStatus`` with the outcome. When the socket disappears kubelet deregisters the plugin; when kubelet
restarts it calls ``GetInfo`` again. :class:`RegistrationServer` serves that socket for one plugin and keeps the last
status kubelet reported, so the plugin's readiness can say whether kubelet accepted it.

The endpoint is a path *as kubelet sees it on the host*. The agent's ``--root`` is where the host's filesystem appears
to the agent (``/`` in the DaemonSet, where the host's ``/var/lib/kubelet`` is mounted at the same path), and kubelet
runs on the host, outside that view. So the endpoint handed to kubelet is the default host path (for CSI
``/var/lib/kubelet/plugins/<driver>/csi.sock``), never the root-prefixed path the agent listens on: with
``--root /host`` the agent listens on ``/host/var/lib/kubelet/...`` and kubelet dials ``/var/lib/kubelet/...``, which
is the same socket. A test that plays kubelet on a temporary root maps the endpoint through the root before dialing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nodeplug.api.pluginregistration.v1 import api_pb2, api_pb2_grpc
from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.log import Logger, get_logger
from nodeplug.metrics import Metrics

CSI_PLUGIN = "CSIPlugin"


@dataclass(frozen=True)
class RegistrationStatus:
    """What kubelet last told us; ``registered`` is None until kubelet has called at all."""

    registered: bool | None = None
    error: str = ""
    info_calls: int = 0

    def describe(self) -> str:
        if self.registered is None:
            if self.info_calls:
                return "kubelet asked for plugin info, registration outcome not yet reported"
            return "not yet registered with kubelet (no kubelet has called the registration socket)"
        if self.registered:
            return "registered with kubelet"
        return f"kubelet rejected the registration: {self.error or 'no reason given'}"


class _Servicer(api_pb2_grpc.RegistrationServicer):
    def __init__(self, owner: RegistrationServer) -> None:
        self._owner = owner

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return self._owner._get_info()

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self._owner._notify(bool(request.plugin_registered), str(request.error))
        return api_pb2.RegistrationStatusResponse()


class RegistrationServer:
    """Serves ``pluginregistration.Registration`` for one plugin on ``socket_path``."""

    def __init__(
        self,
        *,
        socket_path: Path,
        plugin_type: str,
        name: str,
        endpoint: str,
        supported_versions: Sequence[str],
        metrics: Metrics,
        plugin: str,
        log: Logger | None = None,
        on_status: Callable[[RegistrationStatus], None] | None = None,
    ) -> None:
        """``on_status`` is told every status kubelet reports (and the first GetInfo), on the event loop; with it, the
        owner logs a rejection (it may be an answer rather than a failure: DRA's ``enabled: auto``)."""
        if not name:
            raise ValueError("plugin registration needs a plugin name")
        self.socket_path = Path(socket_path)
        self.plugin_type = plugin_type
        self.name = name
        self.endpoint = endpoint
        self.supported_versions = list(supported_versions)
        self.log = log or get_logger(plugin)
        self.status = RegistrationStatus()
        self.on_status = on_status
        self._server = UnixGrpcServer(
            self.socket_path, plugin, metrics, self.log, quiet=("GetInfo", "NotifyRegistrationStatus")
        )
        self._server.add(api_pb2_grpc.add_RegistrationServicer_to_server, _Servicer(self))

    def _get_info(self) -> Any:
        self.status = replace(self.status, info_calls=self.status.info_calls + 1)
        if self.status.info_calls == 1 and self.on_status is not None:
            self.on_status(self.status)
        return api_pb2.PluginInfo(
            type=self.plugin_type,
            name=self.name,
            endpoint=self.endpoint,
            supported_versions=self.supported_versions,
        )

    def _notify(self, registered: bool, error: str) -> None:
        self.status = replace(self.status, registered=registered, error=error)
        if registered:
            self.log.info("kubelet registered the plugin", name=self.name, type=self.plugin_type)
        elif self.on_status is None:
            self.log.error("kubelet rejected the plugin registration", name=self.name, error=error)
        if self.on_status is not None:
            self.on_status(self.status)

    async def start(self) -> None:
        self.status = RegistrationStatus()
        await self._server.start()

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace)

    @property
    def serving(self) -> bool:
        return self._server.serving

    @property
    def rejected(self) -> bool:
        return self.status.registered is False
