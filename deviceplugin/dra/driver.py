"""The DRA driver's lifecycle inside the device plugin: API client, claim store, gRPC service, registration with
kubelet's plugin watcher, ResourceSlice publishing and the device-plugin holds.

``start``:

1. the agent's Kubernetes client and node name (an error when the agent runs single-node: DRA cannot work without
   the API);
2. the prepared-claims database (:mod:`deviceplugin.dra.store`), opened and read on a worker thread, whose claims
   hold their devices at once;
3. the DRA gRPC service (``v1`` and ``v1beta1``) on ``<root>/var/lib/kubelet/plugins/<driver>/dra.sock``, then the
   registration socket ``<root>/var/lib/kubelet/plugins_registry/<driver>-reg.sock`` (type ``DRAPlugin``,
   supported versions ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin``: kubelet 1.34+ takes the first it knows, 1.32 the
   v1beta1 one; endpoint: the DRA socket's path as kubelet sees it on the host);
4. in the background: API discovery of the ``resource.k8s.io`` version (retried with backoff while the API server
   is away), then the slice publisher; and, for resources offered both ways, the pod-resources poll.

Nothing in ``start`` waits for the API server. Until the version is known, a claim not yet prepared gets an error
naming the reason (kubelet retries); prepared claims are answered and unprepared from the database.

With ``enabled: auto`` the driver starts the same way and then follows :func:`deviceplugin.dra.auto.decide` over
the API server's discovery answer and kubelet's registration status: the slices are published only while DRA is on;
while it is off (an API server without ``resource.k8s.io``, re-asked every ``resync_seconds`` and whenever kubelet
reports again; a kubelet without DRA, which tells the registration socket so) the pool is published empty, so the
scheduler puts no claim on this node, ``/readyz`` says "DRA off" and why, and the log says so once per change. The
sockets stay served, so a kubelet restarted with DRA registers the driver and turns it on; claims prepared before
keep their devices until kubelet unprepares them.

``stop(remove=False)`` leaves the slices published: an agent restart (or upgrade) keeps them, and kubelet deletes
them itself if the driver stays away. ``stop(remove=True)`` (the driver disabled by a config reload) deletes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric

from deviceplugin import health
from deviceplugin.config import Resource
from deviceplugin.discovery import Device
from deviceplugin.dra import auto, podresources
from deviceplugin.dra.claims import Claim, ClaimError
from deviceplugin.dra.config import DraConfig
from deviceplugin.dra.inventory import POLL_SECONDS, InventoryView
from deviceplugin.dra.kubeapi import ClaimReader, VersionUnavailable, served_version
from deviceplugin.dra.prepare import Offered, Preparer
from deviceplugin.dra.publisher import SlicePublisher
from deviceplugin.dra.servicer import SUPPORTED_SERVICES, Handler, V1Beta1Servicer, V1Servicer
from deviceplugin.dra.slices import SliceDevice
from deviceplugin.dra.store import ClaimStore
from deviceplugin.resource import ResourceRuntime
from deviceplugin.state import Listed
from nodeplug.api.dra.v1 import api_pb2_grpc as v1_grpc
from nodeplug.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from nodeplug.grpcserve import UnixGrpcServer
from nodeplug.kube import Backoff, KubeClient, KubeError
from nodeplug.kube.events import EventRecorder
from nodeplug.log import Logger
from nodeplug.metrics import Metrics
from nodeplug.paths import KUBELET_DIR, PLUGINS_DIR, PLUGINS_REGISTRY_DIR, Root
from nodeplug.pluginwatcher import RegistrationServer, RegistrationStatus

DRA_PLUGIN = auto.DRA_PLUGIN
POD_RESOURCES_SOCKET = KUBELET_DIR + "/pod-resources/kubelet.sock"


def dra_socket_default(driver: str) -> str:
    return f"{PLUGINS_DIR}/{driver}/dra.sock"


def registration_socket_default(driver: str) -> str:
    return f"{PLUGINS_REGISTRY_DIR}/{driver}-reg.sock"


class _Source:
    """The preparer's ClaimSource until the API version is known."""

    def __init__(self) -> None:
        self.reader: ClaimReader | None = None

    async def get_claim(self, namespace: str, name: str) -> Claim:
        if self.reader is None:
            raise ClaimError(
                f"ResourceClaim {namespace}/{name} cannot be read yet: the API server has not been reached "
                "(kubelet will ask again)"
            )
        return await self.reader.get_claim(namespace, name)


class _Devices:
    """The preparer's Devices: the inventory view plus the device plugin's side effects."""

    def __init__(self, driver: DraDriver) -> None:
        self.d = driver

    def offered(self, name: str) -> Offered | None:
        return self.d.view.offered(name)

    def in_use_elsewhere(self, resource: str, device_id: str) -> str:
        return self.d.view.in_use_elsewhere(resource, device_id)

    def claims_changed(self) -> None:
        self.d.apply_holds()

    async def reset(self, resource: Resource, devices: Sequence[Device]) -> None:
        if resource.reset is not None:
            await health.reset(resource.reset, devices, self.d.host_root)


class _SlicesCollector:
    """``nodeplug_dra_slices_published{driver}``: 1 while this node's ResourceSlices list exactly the devices offered
    through DRA (the last comparison or write succeeded), 0 before the API server was reached and the slices first
    listed, or while writing them fails."""

    def __init__(self, driver: DraDriver) -> None:
        self._driver = driver

    def collect(self) -> Iterator[Metric]:
        d = self._driver
        g = GaugeMetricFamily(
            "nodeplug_dra_slices_published",
            "1 while this node's ResourceSlices list exactly the devices offered through DRA.",
            labels=["driver"],
        )
        pub = d.publisher
        g.add_metric([d.cfg.driver_name], 1 if pub is not None and pub.synced and pub.current else 0)
        yield g

    def describe(self) -> Iterator[Metric]:
        return iter(())


class DraDriver:
    def __init__(
        self,
        cfg: DraConfig,
        *,
        root: Root,
        host_root: str,
        runtimes: Callable[[], Mapping[str, ResourceRuntime]],
        metrics: Metrics,
        cdi_dir: Path,
        log: Logger,
        kube: KubeClient | None,
        node: str,
        events: EventRecorder | None = None,
    ) -> None:
        self.cfg = cfg
        self.events = events
        self.root = root
        self.host_root = host_root
        self.runtimes = runtimes
        self.metrics = metrics
        self.cdi_dir = cdi_dir
        self.log = log.bind(driver=cfg.driver_name)
        self.view = InventoryView(runtimes)
        self.socket = root(dra_socket_default(cfg.driver_name))
        self.registration_socket = root(registration_socket_default(cfg.driver_name))
        self.pod_resources = root(POD_RESOURCES_SOCKET)
        self.client = kube
        self.node = node
        self.version = ""
        self.store: ClaimStore | None = None
        self.preparer: Preparer | None = None
        self.publisher: SlicePublisher | None = None
        self.registration: RegistrationServer | None = None
        self._server: UnixGrpcServer | None = None
        self._source = _Source()
        self._tasks: list[asyncio.Task[None]] = []
        self._collector = _SlicesCollector(self)
        self.auto = cfg.enabled == "auto"
        self.api = auto.UNKNOWN_API
        self.decision = auto.Decision(None, "not started") if self.auto else auto.Decision(True, "enabled: true")
        self._recheck = asyncio.Event()  # ask the API server again now (auto, while it said no)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.client is None or not self.node:
            raise RuntimeError(
                "deviceplugin.dra.enabled needs the Kubernetes API: run the agent with --kubeconfig or KUBECONFIG, "
                "or in a pod with a service account"
            )
        # Opened, migrated and read (the devices prepared claims hold) on a worker thread: a slow disk holds back the
        # driver's start, never the event loop, which serves the device plugin meanwhile.
        self.store, preparer = await asyncio.to_thread(self._open_store)
        self.preparer = preparer
        self.metrics.registry.register(self._collector)
        self.attach()
        self.apply_holds()
        handler = Handler(preparer, self.log, self.events, lambda: self.version)
        server = UnixGrpcServer(self.socket, plugin="dra", metrics=self.metrics, log=self.log)
        server.add(v1_grpc.add_DRAPluginServicer_to_server, V1Servicer(handler))
        server.add(v1beta1_grpc.add_DRAPluginServicer_to_server, V1Beta1Servicer(handler))
        await server.start()
        self._server = server
        self.registration = RegistrationServer(
            socket_path=self.registration_socket,
            plugin_type=DRA_PLUGIN,
            name=self.cfg.driver_name,
            endpoint=dra_socket_default(self.cfg.driver_name),
            supported_versions=SUPPORTED_SERVICES,
            metrics=self.metrics,
            plugin="dra",
            log=self.log,
            on_status=self._registration_status,
        )
        await self.registration.start()
        self._decide()
        self._tasks.append(asyncio.create_task(self._connect(), name="dra-connect"))
        if self.view.shared():
            self._tasks.append(asyncio.create_task(self._poll_holds(), name="dra-holds"))
        self.log.info("DRA driver started", node=self.node, api=self.client.source.origin, socket=str(self.socket))

    def _open_store(self) -> tuple[ClaimStore, Preparer]:
        store = ClaimStore(self.root(self.cfg.state_dir) / "claims.db")
        try:
            return store, Preparer(
                driver=self.cfg.driver_name,
                pool=self.node,
                store=store,
                source=self._source,
                devices=_Devices(self),
                cdi_dir=self.cdi_dir,
                log=self.log,
            )
        except BaseException:
            store.close()
            raise

    async def stop(self, grace: float, remove: bool = False) -> None:
        with contextlib.suppress(KeyError):  # not registered: the start failed before
            self.metrics.registry.unregister(self._collector)
        if self.registration is not None:
            await self.registration.stop(grace)  # kubelet deregisters us first
            self.registration = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        if self.publisher is not None:
            await self.publisher.stop()
            if remove:
                try:
                    await asyncio.wait_for(self.publisher.remove_all(), 10)
                    self.log.info("ResourceSlices removed")
                except (KubeError, TimeoutError) as e:
                    self.log.warning("ResourceSlices not removed (kubelet removes them later)", error=str(e))
            self.publisher = None
        for rt in self.runtimes().values():
            rt.on_change = rt.on_allocate = None
            rt.set_held({})
        store, self.store = self.store, None
        if store is not None:
            await asyncio.to_thread(store.close)  # a checkpoint of the WAL: disk work, off the loop

    def attach(self) -> None:
        """Hook into the resources (again after the device plugin restarted some on reload)."""
        for rt in self.runtimes().values():
            rt.on_change = self.changed
            rt.on_allocate = self.allocated
        self.view.invalidate()
        self.apply_holds()
        self.changed()

    @property
    def ready(self) -> tuple[bool, str]:
        if self._server is None or not self._server.serving:
            return False, "DRA socket not serving"
        if self.auto and self.decision.on is not True:
            # off is an answer, not a failure; undecided is only a failure when kubelet refused for another reason
            rejected = self.registration is not None and self.registration.rejected and self.decision.on is None
            return not rejected, self.decision.describe()
        if self.registration is not None and self.registration.rejected:
            return False, self.registration.status.describe()
        if not self.version:
            return True, "DRA serving; API server not reached yet"
        pub = self.publisher
        if pub is not None and pub.last_error:
            return True, f"DRA serving; ResourceSlices behind: {pub.last_error}"
        return True, "DRA serving"

    # ------------------------------------------------------------ events from the device plugin

    def changed(self) -> None:
        self.view.invalidate()
        if self.publisher is not None:
            self.publisher.kick()

    def allocated(self, resource: str, entries: list[Listed]) -> None:
        if self.view.allocated(resource, entries) and self.publisher is not None:
            self.publisher.kick()
        if self.view.holds.held and not any(t.get_name() == "dra-holds" and not t.done() for t in self._tasks):
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.create_task(self._poll_holds(), name="dra-holds"))

    def apply_holds(self) -> None:
        if self.preparer is None:
            return
        held = self.preparer.held()
        for name, rt in self.runtimes().items():
            if rt.res.via_deviceplugin:
                rt.set_held(held.get(name, {}) if rt.res.via_dra else {})

    # ------------------------------------------------------------ background

    def _registration_status(self, status: RegistrationStatus) -> None:
        if status.registered is False and not (self.auto and auto.takes_no_dra(status.error)):
            self.log.error("kubelet rejected the plugin registration", error=status.error)
        if self.auto and self.api.says is False:
            self._recheck.set()  # kubelet came (back): ask the API server again too
        self._decide()

    def _decide(self) -> None:
        """Follow the answers (auto); start the publisher once DRA is decided and the version known."""
        if self.auto:
            st = self.registration.status if self.registration is not None else RegistrationStatus()
            kubelet = auto.kubelet_answer(st.registered, st.error, called=st.info_calls > 0)
            decision = auto.decide(self.api, kubelet)
            if decision != self.decision:
                if decision.on is not None or self.decision.on is not None:  # undecided -> undecided: quiet
                    self.log.info(decision.describe())
                self.decision = decision
        if self.decision.on is None or not self.version:
            return
        if self.publisher is None:
            assert self.client is not None  # start() refuses to run without one
            self.publisher = SlicePublisher(
                self.client,
                version=self.version,
                driver=self.cfg.driver_name,
                node=self.node,
                desired=self._desired,
                log=self.log,
                resync_seconds=self.cfg.resync_seconds,
            )
            self.publisher.start()
        self.publisher.kick()

    def _desired(self) -> list[SliceDevice]:
        """What the pool offers: every free device while DRA is on, nothing while it is off."""
        return self.view.desired() if self.decision.on else []

    async def _connect(self) -> None:
        assert self.client is not None
        backoff, attempt = Backoff(base=0.2, cap=10.0), 0
        while not self.version:
            self._recheck.clear()
            try:
                version = await served_version(self.client, self.cfg.api_version)
            except KubeError as e:
                if self.auto and isinstance(e, VersionUnavailable):  # an answer: DRA off until it serves one
                    self.api = auto.api_answer("", str(e))
                    self._decide()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._recheck.wait(), self.cfg.resync_seconds)
                    continue
                await self._retry_later(backoff, attempt, e)
                attempt += 1
                continue
            self.version = version
        self.api = auto.api_answer(self.version)
        self._source.reader = ClaimReader(self.client, self.version)
        self.log.info("following the API server", resource_api=f"resource.k8s.io/{self.version}")
        self._decide()

    async def _retry_later(self, backoff: Backoff, attempt: int, e: KubeError) -> None:
        delay = backoff.delay(attempt)
        if attempt in (0, 9) or (attempt + 1) % 50 == 0:
            self.log.warning("API server not usable yet; retrying", error=str(e), delay=round(delay, 2))
        await asyncio.sleep(delay)

    async def _poll_holds(self) -> None:
        """Read kubelet's pod resources, release or take holds, while anything is held (and once at start, which
        finds the holds of pods that kept their devices through an agent restart): the next Allocate of a resource
        offered both ways starts it again."""
        warned = False
        while shared := self.view.shared():
            try:
                using = await podresources.in_use(self.pod_resources)
            except Exception as e:  # keep every hold: a device is never offered twice
                if not warned:
                    self.log.warning("kubelet pod-resources API not readable; device-plugin holds kept", error=str(e))
                    warned = True
            else:
                warned = False
                if self.view.holds.reconcile(using, shared, time.monotonic()):
                    self.changed()
                if not self.view.holds.held:
                    return
            await asyncio.sleep(POLL_SECONDS)
