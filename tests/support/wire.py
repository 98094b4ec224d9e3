"""Watching the wire: which method paths a gRPC server was called with."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio


class MethodRecorder(aio.ServerInterceptor):
    """Records the full method path (``/<package>.<Service>/<Rpc>``) of every call a server receives."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        self.methods.append(details.method)
        return await continuation(details)
