"""Registering a resource with kubelet, and knowing which kubelet we registered with.

:func:`register` makes one ``Registration/Register`` call on ``kubelet.sock`` (version ``v1beta1``, endpoint = our
socket's file name, resource name ``nodeplug.io/<name>``, our options). :func:`identity` tells one socket file from
another at the same path (inode and change time), which is how a kubelet restart (a new ``kubelet.sock``) and a
wiped directory (our socket gone or replaced) are recognised whatever inotify did or did not report.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from deviceplugin.config import Resource
from deviceplugin.servicer import options
from nodeplug.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

API_VERSION = "v1beta1"

Identity = tuple[int, int, int]


def identity(path: Path, with_ctime: bool = True) -> Identity | None:
    """Which file is at ``path``: device and inode, and the change time (a re-created file may reuse the inode).

    Our own socket is told apart without the change time, so a chmod on it does not look like a new file.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns if with_ctime else 0)


def request(res: Resource) -> api_pb2.RegisterRequest:
    return api_pb2.RegisterRequest(
        version=API_VERSION, endpoint=res.socket_name, resource_name=res.resource_name, options=options(res)
    )


async def register(kubelet_socket: Path, res: Resource, timeout: float) -> None:
    """One Register call; raises :class:`grpc.aio.AioRpcError` or :class:`OSError` when kubelet is not there."""
    if identity(kubelet_socket) is None:  # a stat, not a wait: fine in the loop
        raise FileNotFoundError(f"{kubelet_socket} does not exist (kubelet not running?)")
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        await stub.Register(request(res), timeout=timeout)


def describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)
