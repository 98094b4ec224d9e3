"""Container edits for allocated devices, as an Allocate answer or as a CDI spec.

:func:`container_edits` is the pure answer for one container: a DeviceSpec for every node of the allocated devices
(each node once, even when two replicas share it), the resource's mounts and env, and ``NODEPLUG_<NAME>_DEVICES``
listing the allocated IDs. With ``cdi: true`` the device nodes, mounts and env live in the resource's CDI spec
instead, and the answer names the CDI devices (``nodeplug.io/<name>=<id>``); the IDs env stays in the answer.

The CDI spec (``cdiVersion`` 0.6.0, ``kind`` ``nodeplug.io/<name>``) has one device entry per listed ID with its
device nodes, and the resource's mounts and env as spec-wide container edits. It is written atomically (temp file in
the same directory, fsync, rename, fsync of the directory) to ``<cdi dir>/nodeplug.io-<name>.json``, and only when its
content changes. :func:`sync_spec` is that whole step for one listing; it blocks on the disk, so the device plugin
runs it on a worker thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.config import Resource
from deviceplugin.discovery import Device
from deviceplugin.state import Listed
from nodeplug.fsutil import write_atomic

CDI_VERSION = "0.6.0"
VENDOR = "nodeplug.io"


@dataclass(frozen=True)
class DeviceSpec:
    container_path: str
    host_path: str
    permissions: str


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass
class ContainerEdits:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    devices: list[DeviceSpec] = field(default_factory=list)
    cdi_devices: list[str] = field(default_factory=list)


def kind(res: Resource) -> str:
    return f"{VENDOR}/{res.name}"


def qualified(res: Resource, dev_id: str) -> str:
    return f"{kind(res)}={dev_id}"


def spec_filename(res: Resource) -> str:
    return f"{VENDOR}-{res.name}.json"


def container_edits(res: Resource, entries: Sequence[Listed]) -> ContainerEdits:
    out = ContainerEdits()
    out.envs[res.env_name] = ",".join(e.id for e in entries)
    if res.cdi:
        out.cdi_devices = [qualified(res, e.id) for e in entries]
        return out
    out.envs = {**res.env, **out.envs}
    seen: set[str] = set()
    for e in entries:
        for node in e.device.nodes:
            if node.container_path not in seen:
                seen.add(node.container_path)
                out.devices.append(DeviceSpec(node.container_path, node.host_path, res.permissions))
    out.mounts = [Mount(m.container_path, m.host_path, m.read_only) for m in res.mounts]
    return out


def device_node_edits(res: Resource, device: Device) -> list[dict[str, str]]:
    """CDI ``deviceNodes`` for ``device``'s nodes, with the resource's permissions (device plugin and DRA alike)."""
    return [{"path": n.container_path, "hostPath": n.host_path, "permissions": res.permissions} for n in device.nodes]


def mount_edits(res: Resource) -> list[dict[str, Any]]:
    """CDI ``mounts`` for the resource's configured mounts (bind mounts, read-only where configured)."""
    out: list[dict[str, Any]] = []
    for m in res.mounts:
        access = "ro" if m.read_only else "rw"
        out.append({"hostPath": m.host_path, "containerPath": m.container_path, "options": ["rbind", access]})
    return out


def build_spec(res: Resource, listing: Sequence[Listed]) -> dict[str, Any]:
    """The CDI spec of ``res`` for every listed ID (healthy or not: kubelet decides what it allocates)."""
    devices = [{"name": e.id, "containerEdits": {"deviceNodes": device_node_edits(res, e.device)}} for e in listing]
    edits: dict[str, Any] = {}
    if res.env:
        edits["env"] = [f"{k}={v}" for k, v in res.env.items()]
    if res.mounts:
        edits["mounts"] = mount_edits(res)
    spec: dict[str, Any] = {"cdiVersion": CDI_VERSION, "kind": kind(res), "devices": devices}
    if edits:
        spec["containerEdits"] = edits
    return spec


def write_spec(directory: Path, res: Resource, spec: dict[str, Any]) -> Path:
    """Write ``spec`` atomically; a reader sees the old file or the new one, never a part."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / spec_filename(res)
    write_atomic(path, json.dumps(spec, indent=2, sort_keys=False).encode() + b"\n")
    return path


def remove_spec(directory: Path, res: Resource) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / spec_filename(res)).unlink()


def sync_spec(
    directory: Path, res: Resource, listing: Sequence[Listed], written: str | None, force: bool = False
) -> str:
    """Make the spec file say ``listing`` (removed when the listing is empty) and return what it says now, as
    compared text ("" for no file). ``written`` is what the last call returned (None: not known), so an unchanged
    listing costs no write; ``force`` writes anyway (the file was removed, or the last write failed). Blocking
    (OSError when the disk refuses)."""
    if not listing:
        if written != "" or force:
            remove_spec(directory, res)
        return ""
    spec = build_spec(res, listing)
    text = json.dumps(spec, sort_keys=True)
    if force or text != written:
        write_spec(directory, res, spec)
    return text
