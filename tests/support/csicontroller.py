"""The Controller and GroupController services over a real unix socket, with the real volume manager on loop-file
volumes in a temporary directory (mkfs on plain files needs no root).

Shared by the controller tests through its fixture ``ctl`` (tests/conftest.py registers this module as a
plugin); request helpers are here, ``cap`` and ``expect`` in :mod:`support.csidriver`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grpc import aio

from csi.config import Config
from csi.controller import ControllerServicer
from csi.groupcontroller import GroupControllerServicer
from csi.state import StateStore
from csi.volumes import VolumeManager
from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.paths import Root

from support.csidriver import cap

MIB = 1 << 20
NODE = "node-a"
AccessMode = csi_pb2.VolumeCapability.AccessMode
needs_mkfs_ext4 = pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")


@dataclass
class ControllerEnv:
    stub: csi_pb2_grpc.ControllerStub
    groups: csi_pb2_grpc.GroupControllerStub
    manager: VolumeManager
    root: Path


@contextlib.asynccontextmanager
async def serve_controller(root: Path) -> AsyncIterator[ControllerEnv]:
    """Both services of a manager whose data dir is under ``root`` (node ``node-a``, at most 20 volumes)."""
    sockdir = Path(tempfile.mkdtemp(prefix="npcsi-"))
    cfg = Config(node_id=NODE, max_volumes_per_node=20)
    store = StateStore(Root(root)(cfg.data_dir) / "state.db")
    manager = VolumeManager(store, cfg, root=Root(root))
    server = aio.server()
    csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(manager), server)
    csi_pb2_grpc.add_GroupControllerServicer_to_server(GroupControllerServicer(manager), server)
    server.add_insecure_port(f"unix://{sockdir}/csi.sock")
    await server.start()
    try:
        async with aio.insecure_channel(f"unix://{sockdir}/csi.sock") as ch:
            yield ControllerEnv(csi_pb2_grpc.ControllerStub(ch), csi_pb2_grpc.GroupControllerStub(ch), manager, root)
    finally:
        await server.stop(0)
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def create_req(name: str = "pvc-1", size: int = 16 * MIB, **kw: Any) -> csi_pb2.CreateVolumeRequest:
    kw.setdefault("volume_capabilities", [cap()])
    return csi_pb2.CreateVolumeRequest(name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size), **kw)


def gone(p: str | Path) -> bool:
    return not os.path.lexists(p)


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[ControllerEnv]:
    """The Controller and GroupController services over a unix socket, on loop-file volumes under ``tmp_path``; no
    root needed."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 (e2fsprogs)")
    async with serve_controller(tmp_path) as env:
        yield env
