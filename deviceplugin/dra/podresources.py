"""Which device IDs kubelet has handed to running pods, from its pod-resources API (``List``).

The device plugin API never says when a container stops using a device, so a device of a resource offered both
ways that was allocated through the device plugin stays withheld from DRA until kubelet no longer lists it for any
pod (:func:`in_use`). A failure raises: the caller keeps every hold (a device is never offered twice).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from nodeplug.api.podresources.v1 import api_pb2, api_pb2_grpc

TIMEOUT = 5.0
MAX_MESSAGE = 64 << 20


async def in_use(socket: Path) -> dict[str, set[str]]:
    """Resource name (``nodeplug.io/fuse``) -> device IDs kubelet lists as assigned to containers."""
    out: dict[str, set[str]] = {}
    async with grpc.aio.insecure_channel(
        f"unix://{socket}", options=[("grpc.max_receive_message_length", MAX_MESSAGE)]
    ) as ch:
        resp = await api_pb2_grpc.PodResourcesListerStub(ch).List(api_pb2.ListPodResourcesRequest(), timeout=TIMEOUT)
    for pod in resp.pod_resources:
        for c in pod.containers:
            for d in c.devices:
                out.setdefault(d.resource_name, set()).update(d.device_ids)
    return out
