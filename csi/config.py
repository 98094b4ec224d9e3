"""The ``csi`` section of the agent config.

Every field has a default that works on an ordinary Linux node with no config file: loop-file volumes under
``/var/lib/nodeplug/csi`` (placed under the agent's ``--root``), ext4 by default, the btrfs backend off until a
btrfs mount point is configured. Example::

    csi:
      driver_name: local.csi.nodeplug.io
      default_fs_type: xfs
      btrfs: {enabled: true, path: /mnt/btrfs}
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nodeplug.configbase import Section
from nodeplug.paths import KUBELET_DIR, STATE_DIR

TOPOLOGY_KEY = "topology.local.csi.nodeplug.io/node"
DEFAULT_DRIVER_NAME = "local.csi.nodeplug.io"
DEFAULT_DATA_DIR = STATE_DIR + "/csi"

# CSI: the driver name follows the domain-name notation, at most 63 characters, alphanumerics, '-', '.' and '_'.
_DRIVER_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


class BtrfsConfig(BaseModel):
    """The btrfs backend: volumes are subvolumes of the btrfs filesystem mounted at ``path``."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    enabled: bool = False
    path: str = Field(default="", description="mount point of a btrfs filesystem (absolute, host path)")
    subdir: str = Field(default="nodeplug-csi", description="directory under path that holds the volumes")

    @field_validator("path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if v and not v.startswith("/"):
            raise ValueError("expected an absolute path to a btrfs mount point")
        return v

    @field_validator("subdir")
    @classmethod
    def _subdir(cls, v: str) -> str:
        if not v or "/" in v or v in (".", "..") or "\0" in v:
            raise ValueError("expected one directory name (no '/')")
        return v

    @model_validator(mode="after")
    def _path_when_enabled(self) -> BtrfsConfig:
        if self.enabled and not self.path:
            raise ValueError("path: expected the mount point of a btrfs filesystem when btrfs.enabled is true")
        return self


class Config(Section):
    """Config of the CSI driver (see the module docstring)."""

    driver_name: str = DEFAULT_DRIVER_NAME
    node_id: str = Field(default="", description='node id reported by NodeGetInfo; "" means the host name')
    max_volumes_per_node: int = Field(default=1000, ge=0, le=100_000)
    data_dir: str = DEFAULT_DATA_DIR
    kubelet_dir: str = KUBELET_DIR
    default_fs_type: Literal["ext4", "xfs"] = "ext4"
    default_backend: Literal["loopfile", "btrfs"] = "loopfile"
    reserved_bytes: int = Field(default=0, ge=0, description="free space on the backend kept back from volumes")
    btrfs: BtrfsConfig = BtrfsConfig()
    registration_enabled: bool = True

    @field_validator("driver_name")
    @classmethod
    def _driver_name(cls, v: str) -> str:
        if not _DRIVER_RE.fullmatch(v):
            raise ValueError("expected a domain-like name of at most 63 letters, digits, '.', '-' or '_'")
        return v

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        if len(v) > 128 or any(c.isspace() or c == "/" for c in v):
            raise ValueError("expected at most 128 characters without spaces or '/'")
        return v

    @field_validator("data_dir", "kubelet_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") == "":
            raise ValueError("expected an absolute directory path other than /")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _backend_available(self) -> Config:
        if self.default_backend == "btrfs" and not self.btrfs.enabled:
            raise ValueError("default_backend: btrfs needs btrfs.enabled: true and btrfs.path")
        return self
