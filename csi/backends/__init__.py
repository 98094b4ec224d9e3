"""Volume backends: where a volume's bytes live and how they are created, copied, grown and removed.

Two implementations of :class:`Backend`:

- :class:`csi.backends.loopfile.LoopfileBackend`: a sparse file per volume under a base directory (the driver's
  data dir), formatted ext4/xfs for mount volumes, raw for block volumes; the node side uses it through a loop
  device. Snapshots and clones are file copies (reflink where the filesystem can, else sparse).
- :class:`csi.backends.btrfs.BtrfsBackend`: a btrfs subvolume per mount volume (fs type ``btrfs``), its size
  enforced by a qgroup limit, snapshots and clones as subvolume snapshots; block volumes and ext4/xfs volumes are
  loop files on the same btrfs, copied by reflink.

Backends are pure host-object managers: they never touch the state store and hold no locks; the volume manager
decides what to do, serialises operations and records the results. Freezing a mounted filesystem around a copy is
the manager's job too (it knows the stage records).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from csi.model import Snapshot, Volume


class Backend(Protocol):
    name: str
    base: Path

    def ready(self) -> None:
        """Prepare the base directories (and quotas); raise FailedPrecondition when the backend cannot work."""

    def owns(self, path: str) -> bool:
        """True when ``path`` (a volume or snapshot path) lies in this backend's base directory."""

    def free_bytes(self, volumes: Iterable[Volume]) -> int:
        """Bytes a new volume may still take: free space minus what existing ``volumes`` may still grow into."""

    def supports(self, access_type: str, fs_type: str) -> str:
        """ "" when the combination is supported, else the reason."""

    def create(self, volume_id: str, size: int, access_type: str, fs_type: str) -> str:
        """Create an empty volume; return its path."""

    def create_from_snapshot(self, volume_id: str, size: int, snapshot: Snapshot) -> str:
        """Create a volume shaped like the snapshot's source with the content of ``snapshot``; return its path."""

    def clone(self, volume_id: str, size: int, source: Volume) -> str:
        """Create a volume with the content of ``source``; return its path."""

    def delete(self, volume: Volume) -> None:
        """Remove the volume's bytes; a volume already gone is fine."""

    def expand(self, volume: Volume, new_size: int) -> bool:
        """Grow to ``new_size``; return True when the node must still act (grow loop device and filesystem)."""

    def snapshot(self, snapshot_id: str, volume: Volume) -> tuple[str, int]:
        """Cut a snapshot of ``volume``; return its path and size in bytes."""

    def delete_snapshot(self, snapshot: Snapshot) -> None:
        """Remove a snapshot; already gone is fine."""

    def condition(self, volume: Volume) -> str:
        """ "" when the volume looks healthy, else what is wrong."""
