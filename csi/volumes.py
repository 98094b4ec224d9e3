"""The volume manager: the CSI core's one entry point for volumes, snapshots and group snapshots.

Constructed by the plugin as::

    store = StateStore(ctx.root(config.data_dir) / "state.db")
    manager = VolumeManager(store, config, root=ctx.root)

Every method is synchronous (it runs mkfs, cp, btrfs ...); servicers call it through ``asyncio.to_thread``. Errors
are :mod:`csi.errors` subclasses. ``manager.locks`` is the one :class:`OperationLocks` shared by the Controller and
Node services: hold ``volume/<id>`` around any operation that changes a volume's host state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from csi.config import Config
from csi.locks import OperationLocks
from csi.model import GroupSnapshot, Snapshot, Volume, VolumeSource
from csi.state import StateStore
from nodeplug.paths import Root


@dataclass(frozen=True)
class CapacityRange:
    """CSI capacity range in bytes; 0 means unset."""

    required_bytes: int = 0
    limit_bytes: int = 0


@dataclass(frozen=True)
class Condition:
    abnormal: bool
    message: str


class VolumeManager:
    def __init__(self, store: StateStore, config: Config, root: Root | None = None) -> None:
        self.store = store
        self.config = config
        self.root = root or Root()
        self.locks = OperationLocks()
        self.data_dir = self.root(config.data_dir)

    @property
    def node_id(self) -> str:
        raise NotImplementedError

    def create_volume(
        self,
        name: str,
        capacity_range: CapacityRange,
        access_type: str,
        fs_type: str,
        backend: str,
        parameters: Mapping[str, str],
        source: VolumeSource | None = None,
        ephemeral: bool = False,
    ) -> Volume:
        raise NotImplementedError

    def delete_volume(self, volume_id: str) -> None:
        raise NotImplementedError

    def get_volume(self, volume_id: str) -> Volume:
        raise NotImplementedError

    def list_volumes(self, max_entries: int = 0, starting_token: str = "") -> tuple[list[Volume], str]:
        raise NotImplementedError

    def expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int = 0) -> tuple[int, bool]:
        raise NotImplementedError

    def get_capacity(self, parameters: Mapping[str, str], topology: Mapping[str, str] | None = None) -> int:
        raise NotImplementedError

    def volume_condition(self, volume_id: str) -> Condition:
        raise NotImplementedError

    def create_snapshot(self, name: str, source_volume_id: str, parameters: Mapping[str, str]) -> Snapshot:
        raise NotImplementedError

    def delete_snapshot(self, snapshot_id: str) -> None:
        raise NotImplementedError

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        raise NotImplementedError

    def list_snapshots(
        self, max_entries: int = 0, starting_token: str = "", source_volume_id: str = "", snapshot_id: str = ""
    ) -> tuple[list[Snapshot], str]:
        raise NotImplementedError

    def create_group_snapshot(
        self, name: str, source_volume_ids: list[str], parameters: Mapping[str, str]
    ) -> tuple[GroupSnapshot, list[Snapshot]]:
        raise NotImplementedError

    def delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids: list[str]) -> None:
        raise NotImplementedError

    def get_group_snapshot(
        self, group_snapshot_id: str, snapshot_ids: list[str]
    ) -> tuple[GroupSnapshot, list[Snapshot]]:
        raise NotImplementedError

    def backing_path(self, volume: Volume) -> Path:
        raise NotImplementedError
