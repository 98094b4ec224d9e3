"""The one place CSI domain errors become gRPC statuses.

Every CSI servicer method is wrapped with :func:`rpc`::

    class ControllerServicer(csi_pb2_grpc.ControllerServicer):
        @rpc
        async def CreateVolume(self, request, context): ...

A :class:`csi.errors.CsiError` aborts the call with ``grpc.StatusCode[err.code]`` and the error's message; a
:class:`nodeplug.commands.CommandError` that escaped the core becomes INTERNAL naming the command and its stderr; any
other exception becomes INTERNAL with its type and message (the traceback is logged).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc
from grpc import aio

from csi.errors import CsiError
from nodeplug.commands import CommandError
from nodeplug.log import get_logger

_log = get_logger("csi")

Context: TypeAlias = aio.ServicerContext[Any, Any]  # what a servicer method gets as its second argument

R = TypeVar("R")
S = TypeVar("S")
Q = TypeVar("Q")


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a domain (or unexpected) error maps to."""
    if isinstance(err, CsiError):
        try:
            return grpc.StatusCode[err.code], str(err)
        except KeyError:
            return grpc.StatusCode.INTERNAL, str(err)
    if isinstance(err, CommandError):
        return grpc.StatusCode.INTERNAL, str(err)
    return grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"


def rpc(
    method: Callable[[S, Q, Context], Awaitable[R]],
) -> Callable[[S, Q, Context], Awaitable[R]]:
    """Decorate a grpc.aio servicer method so domain errors abort the call with their status code."""

    @functools.wraps(method)
    async def wrapper(self: S, request: Q, context: Context) -> R:
        try:
            return await method(self, request, context)
        except aio.AbortError:
            raise
        except Exception as e:
            if not isinstance(e, (CsiError, CommandError)):
                _log.error("unexpected error in rpc", exc_info=True, rpc=getattr(method, "__name__", "?"))
            code, msg = status_of(e)
            await context.abort(code, msg)
            raise AssertionError("unreachable: context.abort raises") from e

    return wrapper
