"""The kubelet DRA service, ``DRAPlugin`` of package ``k8s.io.kubelet.pkg.apis.dra.v1beta1`` (kubelet 1.32, 1.33)
and of ``...dra.v1`` (1.34+): the two carry the same messages, so one handler serves both.

Each request is checked as a whole first (at most :data:`MAX_CLAIMS` claims; a malformed request is
INVALID_ARGUMENT and nothing is done); then every claim is handled on its own, concurrently, and its outcome goes
into the response map under the UID kubelet sent: devices, or the error text for that claim alone. An internal
failure for one claim is reported in its entry too, so one bad claim never fails its neighbours.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from deviceplugin.dra.prepare import PrepareError, Preparer
from deviceplugin.dra.store import PreparedDevice
from nodeplug.api.dra.v1 import api_pb2 as v1
from nodeplug.api.dra.v1 import api_pb2_grpc as v1_grpc
from nodeplug.api.dra.v1beta1 import api_pb2 as v1beta1
from nodeplug.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from nodeplug.kube.events import EventRecorder, Regarding
from nodeplug.log import Logger

MAX_CLAIMS = 1024
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # what registration announces, preferred first

Prepared = tuple[tuple[PreparedDevice, ...], str]  # a claim's devices, or the error text


class _Claim(Protocol):
    namespace: str
    uid: str
    name: str


Context = grpc.aio.ServicerContext[Any, Any]


class Handler:
    """What both services do, on the claims of a request of either package; each service builds its own typed
    response from the outcome (per claim UID, in the request's order, each UID once)."""

    def __init__(
        self,
        preparer: Preparer,
        log: Logger,
        events: EventRecorder | None = None,
        api_version: Callable[[], str] = lambda: "v1beta1",
    ) -> None:
        self.preparer = preparer
        self.log = log
        self.events = events
        self.api_version = api_version  # the resource.k8s.io version the driver reads claims in

    def _event(self, c: _Claim, action: str, reason: str, note: str) -> None:
        """An Event on the ResourceClaim, which ``kubectl describe resourceclaim`` shows beside kubelet's own."""
        if self.events is not None:
            regarding = Regarding("ResourceClaim", c.name, c.namespace, c.uid, f"resource.k8s.io/{self.api_version()}")
            self.events.emit(regarding, "Warning", reason, note, action=action)

    @staticmethod
    async def _check(claims: Sequence[_Claim], context: Context) -> None:
        if len(claims) > MAX_CLAIMS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(claims)} claims, at most {MAX_CLAIMS}")

    async def _prepare_one(self, c: _Claim) -> Prepared:
        try:
            ref = self.preparer.check_ref(c.namespace, c.name, c.uid)
            return await self.preparer.prepare(ref), ""
        except PrepareError as e:
            self.log.warning("claim not prepared", claim=f"{c.namespace}/{c.name}", claim_uid=c.uid, error=str(e))
            self._event(c, "Prepare", "ClaimNotPrepared", str(e))
            return (), str(e)
        except Exception as e:
            self.log.error("claim not prepared", exc_info=True, claim_uid=c.uid)
            return (), f"internal error: {e!r}"

    async def _unprepare_one(self, c: _Claim) -> str:
        try:
            ref = self.preparer.check_ref(c.namespace, c.name, c.uid)
            await self.preparer.unprepare(ref)
            return ""
        except PrepareError as e:
            self.log.warning("claim not unprepared", claim_uid=c.uid, error=str(e))
            self._event(c, "Unprepare", "ClaimNotUnprepared", str(e))
            return str(e)
        except Exception as e:
            self.log.error("claim not unprepared", exc_info=True, claim_uid=c.uid)
            return f"internal error: {e!r}"

    async def prepare(self, claims: Sequence[_Claim], context: Context) -> dict[str, Prepared]:
        """Per claim UID: its devices, or the error text. The same claim twice in one request is one entry (the
        preparer did it once)."""
        await self._check(claims, context)
        results = await asyncio.gather(*(self._prepare_one(c) for c in claims))
        out: dict[str, Prepared] = {}
        for c, result in zip(claims, results, strict=True):
            out.setdefault(c.uid, result)
        return out

    async def unprepare(self, claims: Sequence[_Claim], context: Context) -> dict[str, str]:
        """Per claim UID: the error text, "" when done."""
        await self._check(claims, context)
        errors = await asyncio.gather(*(self._unprepare_one(c) for c in claims))
        return dict(zip((c.uid for c in claims), errors, strict=True))


class V1Beta1Servicer(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, handler: Handler) -> None:
        self.h = handler

    async def NodePrepareResources(
        self, request: v1beta1.NodePrepareResourcesRequest, context: Context
    ) -> v1beta1.NodePrepareResourcesResponse:
        out = v1beta1.NodePrepareResourcesResponse()
        for uid, (devices, error) in (await self.h.prepare(request.claims, context)).items():
            entry = out.claims[uid]
            entry.error = error
            entry.devices.extend(
                v1beta1.Device(
                    request_names=d.requests, pool_name=d.pool, device_name=d.device, cdi_device_ids=d.cdi_ids
                )
                for d in devices
            )
        return out

    async def NodeUnprepareResources(
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: Context
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        out = v1beta1.NodeUnprepareResourcesResponse()
        for uid, error in (await self.h.unprepare(request.claims, context)).items():
            out.claims[uid].error = error
        return out


class V1Servicer(v1_grpc.DRAPluginServicer):
    def __init__(self, handler: Handler) -> None:
        self.h = handler

    async def NodePrepareResources(
        self, request: v1.NodePrepareResourcesRequest, context: Context
    ) -> v1.NodePrepareResourcesResponse:
        out = v1.NodePrepareResourcesResponse()
        for uid, (devices, error) in (await self.h.prepare(request.claims, context)).items():
            entry = out.claims[uid]
            entry.error = error
            entry.devices.extend(
                v1.Device(request_names=d.requests, pool_name=d.pool, device_name=d.device, cdi_device_ids=d.cdi_ids)
                for d in devices
            )
        return out

    async def NodeUnprepareResources(
        self, request: v1.NodeUnprepareResourcesRequest, context: Context
    ) -> v1.NodeUnprepareResourcesResponse:
        out = v1.NodeUnprepareResourcesResponse()
        for uid, error in (await self.h.unprepare(request.claims, context)).items():
            out.claims[uid].error = error
        return out
