"""Values of the CSI core: volumes, snapshots, group snapshots, stage and publish records, and id validation.

All are frozen dataclasses; the state store persists them and the servicers translate them to and from csi.v1
messages. Volume and snapshot ids are minted by the driver ("vol-"/"snap-"/"group-" + 32 hex digits) and checked with
:func:`validate_id` wherever one arrives from a caller, so an id can always be used as a file name under the data dir.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from csi.errors import InvalidArgument

Backend = Literal["loopfile", "btrfs"]
AccessType = Literal["mount", "block"]
BACKENDS: tuple[str, ...] = ("loopfile", "btrfs")
FS_TYPES: tuple[str, ...] = ("ext4", "xfs", "btrfs")

MAX_ID_LEN = 128
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def validate_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a safe id (``kind`` names the field in the error); raise InvalidArgument otherwise.

    Safe: 1..128 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit, never containing ``..``; so it
    holds no ``/``, no NUL and cannot climb out of a directory when used as a file name.
    """
    if not value:
        raise InvalidArgument(f"{kind}: required field is missing")
    if len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"{kind}: expected at most {MAX_ID_LEN} characters, got {len(value)}")
    if not _ID_RE.fullmatch(value) or ".." in value:
        raise InvalidArgument(
            f"{kind}: expected letters, digits, '.', '_' or '-' (no '/', no '..'), got {value[:MAX_ID_LEN]!r}"
        )
    return value


def issued(kind: str, value: str) -> bool:
    """Whether ``value`` is an id this driver could have issued; an empty one is still InvalidArgument (the field is
    required). For the calls where an id never issued simply names nothing: a delete of it is done already, a lookup
    finds nothing."""
    if not value:
        raise InvalidArgument(f"{kind}: required field is missing")
    try:
        validate_id(kind, value)
    except InvalidArgument:
        return False
    return True


def derive_id(prefix: str, name: str) -> str:
    """The id for the CO's ``name``: the same name always gives the same id, so a retry after a crash finds what
    the interrupted attempt left."""
    return f"{prefix}-{hashlib.sha256(name.encode()).hexdigest()[:32]}"


MAX_NAME_BYTES = 128


def validate_name(field: str, name: str) -> str:
    """A CO-chosen name: required, at most 128 bytes (the CSI size limit), no control characters."""
    if not name:
        raise InvalidArgument(f"{field}: required field is missing")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidArgument(f"{field}: expected at most {MAX_NAME_BYTES} bytes, got {len(name.encode())}")
    if any((ord(c) < 0x20 and c not in "\t\n\r") or 0x7F <= ord(c) <= 0x9F for c in name):
        raise InvalidArgument(f"{field}: control characters are not allowed, got {name!r}")
    return name


@dataclass(frozen=True)
class Volume:
    """A provisioned volume.

    ``path`` is the backing file (loopfile, and btrfs block mode) or the btrfs subvolume directory (btrfs mount mode).
    ``fs_type`` is "" for block volumes. ``parameters`` are the StorageClass parameters it was created with.
    """

    volume_id: str
    name: str
    capacity_bytes: int
    backend: Backend
    access_type: AccessType
    fs_type: str
    path: str
    source_snapshot_id: str = ""
    source_volume_id: str = ""
    parameters: Mapping[str, str] = field(default_factory=dict)
    ephemeral: bool = False
    created_at: float = 0.0

    @property
    def is_block(self) -> bool:
        return self.access_type == "block"

    @property
    def is_subvolume(self) -> bool:
        """True when the volume is a btrfs subvolume: bind-mounted from ``path``, no loop device, no mkfs.

        Every other volume is a backing file at ``path`` (formatted with ``fs_type`` in mount mode) used through a
        loop device, on either backend.
        """
        return self.backend == "btrfs" and self.access_type == "mount" and self.fs_type == "btrfs"


@dataclass(frozen=True)
class VolumeSource:
    """Where a new volume's content comes from: a snapshot (``kind="snapshot"``) or a volume (``"volume"``)."""

    kind: Literal["snapshot", "volume"]
    id: str


@dataclass(frozen=True)
class Snapshot:
    """A point-in-time copy of a volume: a file copy (loopfile, btrfs block) or a read-only btrfs subvolume."""

    snapshot_id: str
    name: str
    source_volume_id: str
    size_bytes: int
    path: str
    created_at: float
    ready_to_use: bool = True
    group_snapshot_id: str = ""
    # The source volume's shape, kept so a restore can be checked and built after the source is deleted.
    backend: str = ""
    access_type: str = ""
    fs_type: str = ""

    @property
    def is_subvolume(self) -> bool:
        return self.backend == "btrfs" and self.access_type == "mount" and self.fs_type == "btrfs"


@dataclass(frozen=True)
class GroupSnapshot:
    """Snapshots of several volumes taken together (CSI GroupController)."""

    group_snapshot_id: str
    name: str
    snapshot_ids: tuple[str, ...]
    created_at: float
    ready_to_use: bool = True


@dataclass(frozen=True)
class Condition:
    """A volume's health as CSI's VolumeCondition reports it."""

    abnormal: bool
    message: str


@dataclass(frozen=True)
class StageRecord:
    """A volume staged on this node: its staging path and the device used (loop device, or "" for a subvolume)."""

    volume_id: str
    staging_path: str
    device: str


@dataclass(frozen=True)
class PublishRecord:
    """A volume published to a target path (bind mount of the staging path or device).

    ``created``: the driver created the target (directory, or file for a device node) and removes it on unpublish;
    a target that was there before is left where it was.
    """

    volume_id: str
    target_path: str
    readonly: bool
    staging_path: str
    created: bool = False
