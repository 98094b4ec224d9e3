"""The CSI plugin's lifecycle: open the state, reconcile it with the host, serve the CSI socket, register with kubelet.

``start()``:

1. opens the SQLite store under ``<root>/<data_dir>`` and builds the volume manager;
2. reconciles records with the host. Stage and publish records whose mounts or loop devices are gone (a reboot, a
   kill -9 at the wrong moment) are reported, not repaired behind kubelet's back and never deleted together with
   data: kubelet stages and publishes again after a reboot, and NodeStageVolume re-attaches and re-mounts;
3. serves Identity, Controller, GroupController and Node on ``<root>/var/lib/kubelet/plugins/<driver>/csi.sock``;
4. serves ``pluginregistration`` on ``<root>/var/lib/kubelet/plugins_registry/<driver>-reg.sock``, announcing the CSI
   socket by its host path (see :mod:`nodeplug.pluginwatcher` for why it is not root-prefixed);
5. measures how full volumes and backends are for ``/metrics`` (:mod:`csi.metrics`) and, when the agent follows a
   Kubernetes API, adopts the pre-provisioned VolumeSnapshotContents naming this node's snapshots
   (:mod:`csi.snapshotimport`).

Readiness: ready when both sockets are served and kubelet has not rejected the registration. On a node where no
kubelet ever dials the registration socket (a bare host, the demo, tests) the driver is still usable through its
socket, so "not yet registered" is ready and said in the detail; a registration kubelet *rejected* is not ready.
``stop(grace)`` stops both servers and removes both sockets; mounts and loop devices stay (pods keep their volumes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from csi import loopdev, mounts
from csi.config import Config
from csi.controller import ControllerServicer
from csi.groupcontroller import GroupControllerServicer
from csi.identity import IdentityServicer
from csi.metrics import Sampler
from csi.node import NodeServicer
from csi.nodehost import NodeHost
from csi.state import StateStore
from csi.volumes import VolumeManager
from nodeplug.api.csi.v1 import csi_pb2_grpc
from nodeplug.grpcserve import DEFAULT_QUIET, UnixGrpcServer
from nodeplug.kube.events import EventType, Regarding
from nodeplug.log import Logger
from nodeplug.paths import PLUGINS_DIR, PLUGINS_REGISTRY_DIR
from nodeplug.plugin import AgentContext, Readiness

if TYPE_CHECKING:
    from csi.snapshotimport import SnapshotImporter
from nodeplug.pluginwatcher import CSI_PLUGIN, RegistrationServer

SUPPORTED_VERSIONS = ("1.0.0",)
QUIET = DEFAULT_QUIET | {
    "NodeGetInfo",
    "NodeGetVolumeStats",
    "ControllerGetCapabilities",
    "GroupControllerGetCapabilities",
}


def csi_socket_default(driver: str) -> str:
    """The CSI socket's path on the host, as kubelet dials it."""
    return f"{PLUGINS_DIR}/{driver}/csi.sock"


def registration_socket_default(driver: str) -> str:
    return f"{PLUGINS_REGISTRY_DIR}/{driver}-reg.sock"


class CsiPlugin:
    name = "csi"

    def __init__(self, config: Config, ctx: AgentContext) -> None:
        self.config = config
        self.ctx = ctx
        self.log = ctx.logger("csi")
        self.socket_path = ctx.root(csi_socket_default(config.driver_name))
        self.registration_path = ctx.root(registration_socket_default(config.driver_name))
        self.store: StateStore | None = None
        self.manager: VolumeManager | None = None
        self._server: UnixGrpcServer | None = None
        self._registration: RegistrationServer | None = None
        self.missing: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sampler: Sampler | None = None
        self._importer: SnapshotImporter | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        cfg, root = self.config, self.ctx.root
        data_dir = root(cfg.data_dir)
        await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True, mode=0o700)
        self.store = await asyncio.to_thread(StateStore, data_dir / "state.db")
        self.manager = VolumeManager(self.store, cfg, root=root)
        self._loop = asyncio.get_running_loop()
        self.missing = await asyncio.to_thread(reconcile, self.manager, self.log, self._event)
        kubelet_dir = root(cfg.kubelet_dir)
        host = NodeHost(self.manager, root(f"{PLUGINS_DIR}/{cfg.driver_name}/ephemeral"), self.log)
        pv_sizes = None
        if self.ctx.kube is not None:  # lightkube is loaded only by an agent that follows an API server
            from csi.pvsize import PvSizes

            pv_sizes = PvSizes(self.ctx.kube, cfg.driver_name, self.log)
        server = UnixGrpcServer(self.socket_path, "csi", self.ctx.metrics, self.log, quiet=QUIET)
        server.add(csi_pb2_grpc.add_IdentityServicer_to_server, IdentityServicer(cfg.driver_name, self._probe))
        server.add(csi_pb2_grpc.add_ControllerServicer_to_server, ControllerServicer(self.manager))
        server.add(csi_pb2_grpc.add_GroupControllerServicer_to_server, GroupControllerServicer(self.manager))
        server.add(
            csi_pb2_grpc.add_NodeServicer_to_server,
            NodeServicer(cfg, host, self.manager.locks, kubelet_dir, pv_sizes),
        )
        await server.start()
        self._server = server
        if cfg.registration_enabled:
            reg = RegistrationServer(
                socket_path=self.registration_path,
                plugin_type=CSI_PLUGIN,
                name=cfg.driver_name,
                endpoint=csi_socket_default(cfg.driver_name),
                supported_versions=SUPPORTED_VERSIONS,
                metrics=self.ctx.metrics,
                plugin="csi",
                log=self.log,
            )
            try:
                await reg.start()
            except BaseException:
                await server.stop(0)
                self._server = None
                raise
            self._registration = reg
        self._sampler = Sampler(self.manager, self.ctx.metrics.registry, self.log)
        await self._sampler.start()
        if self.ctx.kube is not None and self.ctx.node_name:
            self._importer = self._snapshot_importer(self.store)
            self._importer.start()
        self.log.info("csi driver started", driver=cfg.driver_name, socket=str(self.socket_path))

    async def stop(self, grace: float) -> None:
        if self._importer is not None:
            await self._importer.stop()
            self._importer = None
        if self._sampler is not None:
            await self._sampler.stop()
            self._sampler = None
        if self._registration is not None:
            await self._registration.stop(grace)
            self._registration = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        for path in (self.socket_path, self.registration_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if self.store is not None:
            self.store.close()
            self.store = None

    def readiness(self) -> Readiness:
        if self._server is None or not self._server.serving:
            return Readiness(False, "csi socket not served")
        if not self.config.registration_enabled:
            return Readiness(True, "serving; kubelet registration disabled")
        reg = self._registration
        if reg is None or not reg.serving:
            return Readiness(False, "registration socket not served")
        return Readiness(not reg.rejected, f"serving; {reg.status.describe()}")

    async def reload(self, section: Config) -> None:
        if section == self.config:
            return
        self.log.info("csi config changed: restarting the driver's servers")
        await self.stop(5.0)
        self.config = section
        self.socket_path = self.ctx.root(csi_socket_default(section.driver_name))
        self.registration_path = self.ctx.root(registration_socket_default(section.driver_name))
        await self.start()

    def _snapshot_importer(self, store: StateStore) -> SnapshotImporter:
        """Pre-provisioned VolumeSnapshotContents naming this node's snapshots are adopted (with an API only)."""
        from csi.snapshotimport import SnapshotImporter

        async def holds(snapshot_id: str) -> bool:
            return await asyncio.to_thread(store.get_snapshot, snapshot_id) is not None

        assert self.ctx.kube is not None
        return SnapshotImporter(
            self.ctx.kube,
            driver=self.config.driver_name,
            node=self.ctx.node_name,
            holds=holds,
            events=self.ctx.events,
            log=self.log,
        )

    def _event(self, reason: str, note: str) -> None:
        """A reconcile finding as an Event on this Node (called from the reconcile's thread)."""
        events, node = self.ctx.events, self.ctx.node_name
        if events is None or not node or self._loop is None:
            return
        kind: EventType = "Normal" if reason == "VolumeRepaired" else "Warning"
        self._loop.call_soon_threadsafe(events.emit, Regarding.node(node), kind, reason, note, "Reconcile")

    async def _probe(self) -> bool:
        store = self.store
        if store is None or self._server is None:
            return False
        await asyncio.to_thread(store.count_volumes)  # raises when the database is unusable
        return True


def reconcile(manager: VolumeManager, log: Logger, event: Callable[[str, str], None] | None = None) -> list[str]:
    """Put the host right where that is safe, then compare records with it; return (and log) what is missing.

    A filesystem left frozen by a crash in the middle of a snapshot copy is thawed first (its pod's writers would
    block forever otherwise). Files or subvolumes that no record names are reported, never deleted. Each finding is
    also told to ``event`` (reason, note), for an Event on the Node.
    """
    tell = event or (lambda reason, note: None)
    store = manager.store
    for staging in manager.snapshots.thaw_all():
        log.warning("reconcile: thawed a filesystem a crash left frozen", staging_path=staging)
        tell("VolumeRepaired", f"thawed the filesystem at {staging}, which a crash left frozen during a snapshot")
    for path in manager.unrecorded():
        log.warning("reconcile: data no record names (left in place; remove it by hand if unwanted)", path=str(path))
        tell("VolumeDataUnrecorded", f"{path}: volume data no record names, left in place (remove it if unwanted)")
    table = mounts.mount_table()
    devices = loopdev.attached()  # one sysfs pass, not one per staged volume
    stages = store.list_stages()
    missing: list[str] = []
    for rec in stages:
        v = store.get_volume(rec.volume_id)
        if v is None:
            missing.append(f"stage record of unknown volume {rec.volume_id} at {rec.staging_path}")
            continue
        backing = manager.backing_path(v)
        if not backing.exists():
            missing.append(f"volume {v.volume_id}: backing {backing} is missing")
            continue
        if not v.is_subvolume and loopdev.rw_device(backing, devices) is None:
            missing.append(f"volume {v.volume_id}: loop device gone; NodeStageVolume re-attaches it")
        if not v.is_block and not mounts.is_mounted(rec.staging_path, table):
            missing.append(f"volume {v.volume_id}: not mounted at {rec.staging_path}; NodeStageVolume re-mounts it")
    for pub in store.list_publishes():
        if not mounts.is_mounted(pub.target_path, table):
            missing.append(f"volume {pub.volume_id}: not mounted at target {pub.target_path}")
    for line in missing:
        log.warning("reconcile: host and state disagree", detail=line)
        tell("VolumeNotFoundAtStart", line)
    if not missing:
        log.info("reconcile: host and state agree", stages=len(stages))
    return missing
