"""One CDI spec per prepared claim. Pure except :func:`write` and :func:`remove`.

The spec's kind is ``k8s.<driver>/claim`` and its file ``k8s.<driver>-claim_<uid>.json`` in the CDI directory, so
no two claims share a file and unprepare removes exactly one file it can name from the claim's UID. Each device of
the claim is a CDI device ``<uid>-<device name>`` with its device nodes, the resource's mounts and env, and
``NODEPLUG_<RESOURCE>_DEVICES`` listing the claim's device IDs of that resource; kubelet hands the runtime the
qualified names (``k8s.devices.nodeplug.io/claim=<uid>-fuse-fuse``). Written atomically (:func:`write_atomic`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin.cdi import CDI_VERSION, device_node_edits, mount_edits
from deviceplugin.config import Resource
from deviceplugin.discovery import Device
from nodeplug.fsutil import write_atomic

_SPEC_FILE = re.compile(r"^k8s\.[a-z0-9.-]+-claim_[0-9a-f-]{36}\.json$")


@dataclass(frozen=True)
class ClaimDevice:
    name: str  # the device's name in the pool
    resource: Resource
    device: Device


def kind(driver: str) -> str:
    return f"k8s.{driver}/claim"


def spec_filename(driver: str, uid: str) -> str:
    return f"k8s.{driver}-claim_{uid}.json"


def is_spec_filename(name: str) -> bool:
    return bool(_SPEC_FILE.match(name))


def cdi_name(uid: str, device: str) -> str:
    return f"{uid}-{device}"


def qualified(driver: str, uid: str, device: str) -> str:
    return f"{kind(driver)}={cdi_name(uid, device)}"


def build(driver: str, uid: str, devices: Sequence[ClaimDevice]) -> dict[str, Any]:
    ids: dict[str, list[str]] = {}
    for d in devices:
        ids.setdefault(d.resource.name, []).append(d.device.id)
    entries = []
    for d in devices:
        res = d.resource
        edits: dict[str, Any] = {
            "deviceNodes": device_node_edits(res, d.device),
            "env": [f"{k}={v}" for k, v in res.env.items()] + [f"{res.env_name}={','.join(ids[res.name])}"],
        }
        if res.mounts:
            edits["mounts"] = mount_edits(res)
        entries.append({"name": cdi_name(uid, d.name), "containerEdits": edits})
    return {"cdiVersion": CDI_VERSION, "kind": kind(driver), "devices": entries}


def write(directory: Path, driver: str, uid: str, spec: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / spec_filename(driver, uid)
    write_atomic(path, json.dumps(spec, indent=2).encode() + b"\n")
    return path


def remove(directory: Path, filename: str) -> None:
    """Remove a claim's spec; only a file named like one of ours, directly in ``directory``."""
    if not is_spec_filename(filename):
        raise ValueError(f"refusing to remove {filename!r}: not a claim's CDI spec file")
    with contextlib.suppress(FileNotFoundError):
        (directory / filename).unlink()
