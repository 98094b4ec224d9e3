"""Checks of the Node service's untrusted request fields: paths (kubelet's own shapes) and mount flags.

Pure: resolving a path (``os.path.realpath``) is the only contact with the host; nothing is created or changed.

**Paths.** Inside kubelet's directory is not the same as ours: kubelet keeps its config, its certificates, the pods'
volumes and every plugin's socket there. A staging or target path is accepted only when, symlinks resolved, it has
the shape kubelet gives it (relative to kubelet's directory, ``<x>`` one path component):

=====================  =======================================================================  ==================
shape                  path                                                                     used for
=====================  =======================================================================  ==================
staging                ``plugins/kubernetes.io/csi/<driver or pv>/<volume>/<dir>``              NodeStage, mount
block staging          ``plugins/kubernetes.io/csi/volumeDevices/staging/<volume>``             NodeStage, block
mount target           ``pods/<pod>/volumes/kubernetes.io~csi/<volume>/<dir>``                  NodePublish, mount
block target           ``plugins/kubernetes.io/csi/volumeDevices/publish/<volume>/<pod>``       NodePublish, block
=====================  =======================================================================  ==================

Anything else is INVALID_ARGUMENT naming the field and the shape expected: a mount over ``pods`` or ``plugins`` would
hide every pod's volumes or the plugin sockets. Which volume a path holds is a separate question, answered from the
host (:mod:`csi.holders`) before anything there is used or removed.

**Mount flags.** Option names and values from a small alphabet (no ``,``, spaces or quotes, so a flag cannot smuggle
a second option), and none that change what kind of mount it is (``bind``, ``remount``, ``move``, propagation,
``loop``) or who may use it: ``user``, ``users``, ``owner``, ``group`` (let other users mount or unmount it),
``helper=``/``uhelper=`` (run a helper program on unmount) and ``X-``/``x-`` userspace options (``X-mount.owner``,
``X-mount.mode`` and the like change the mount point's owner and mode). Flags mount(8) itself rejects are found when
staging (:mod:`csi.nodehost`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from csi.errors import InvalidArgument

STAGING = "staging"
BLOCK_STAGING = "block staging"
MOUNT_TARGET = "mount target"
BLOCK_TARGET = "block target"
STAGING_SHAPES = frozenset({STAGING, BLOCK_STAGING})
TARGET_SHAPES = frozenset({MOUNT_TARGET, BLOCK_TARGET})
SHAPE_TEXT = {
    STAGING: "plugins/kubernetes.io/csi/<driver or pv>/<volume>/<dir>",
    BLOCK_STAGING: "plugins/kubernetes.io/csi/volumeDevices/staging/<volume>",
    MOUNT_TARGET: "pods/<pod>/volumes/kubernetes.io~csi/<volume>/<dir>",
    BLOCK_TARGET: "plugins/kubernetes.io/csi/volumeDevices/publish/<volume>/<pod>",
}
_CSI = ("plugins", "kubernetes.io", "csi")
_DEVICES = "volumeDevices"

_FLAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+-]*(=[A-Za-z0-9_.:/+@-]*)?")
_KIND_FLAGS = frozenset(
    {"bind", "rbind", "remount", "move", "loop"}
    | {f"{r}{p}" for r in ("", "r") for p in ("shared", "slave", "private", "unbindable")}
)
_WHO_FLAGS = frozenset({"user", "users", "owner", "group", "nouser", "helper", "uhelper"})


def shape_of(parts: tuple[str, ...]) -> str | None:
    """Which of kubelet's shapes a path has, given its components relative to kubelet's directory; None for none."""
    if parts[:3] == _CSI and len(parts) >= 6:
        if parts[3] == _DEVICES:
            if len(parts) == 6 and parts[4] == "staging":
                return BLOCK_STAGING
            if len(parts) == 7 and parts[4] == "publish":
                return BLOCK_TARGET
            return None
        return STAGING if len(parts) == 6 else None
    if len(parts) == 6 and parts[0] == "pods" and parts[2] == "volumes" and parts[3] == "kubernetes.io~csi":
        return MOUNT_TARGET
    return None


def checked_path(
    field: str, value: str, kubelet_dir: Path, shapes: Iterable[str], required: bool = True
) -> tuple[Path, str] | None:
    """``value`` resolved (symlinks followed) and its shape, when it is absolute and, resolved, has one of ``shapes``
    inside ``kubelet_dir``; INVALID_ARGUMENT naming ``field`` otherwise. None for an empty optional field."""
    if not value:
        if required:
            raise InvalidArgument(f"{field}: required field is missing")
        return None
    if "\0" in value or not value.startswith("/"):
        raise InvalidArgument(f"{field}: expected an absolute path, got {value[:256]!r}")
    if ".." in Path(value).parts:
        raise InvalidArgument(f"{field}: must not contain '..', got {value[:256]!r}")
    resolved = Path(os.path.realpath(value))
    base = Path(os.path.realpath(kubelet_dir))
    if resolved == base or base not in resolved.parents:
        raise InvalidArgument(f"{field}: expected a path inside {base} (after resolving symlinks), got {value[:256]!r}")
    wanted = sorted(shapes)
    shape = shape_of(resolved.relative_to(base).parts)
    if shape not in wanted:
        expected = " or ".join(f"{base}/{SHAPE_TEXT[s]}" for s in wanted)
        resolved_note = f" (resolved: {str(resolved)[:256]!r})" if str(resolved) != value else ""
        raise InvalidArgument(f"{field}: expected kubelet's {expected}, got {value[:256]!r}{resolved_note}")
    return resolved, shape


def lookup_path(field: str, value: str) -> Path:
    """A path only compared with the driver's records (stats, expand): required, resolved when absolute.

    These RPCs never act on the path they are given, only on paths recorded when the volume was staged or published
    (which passed :func:`checked_path`), so a path outside kubelet's directory or a relative one is simply not where
    the volume is: NOT_FOUND, as the spec's tables say, rather than INVALID_ARGUMENT.
    """
    if not value:
        raise InvalidArgument(f"{field}: required field is missing")
    if "\0" in value:
        raise InvalidArgument(f"{field}: must not contain NUL")
    return Path(os.path.realpath(value)) if value.startswith("/") else Path(value)


def flag_problem(flag: str) -> str:
    """Why ``flag`` is not an acceptable mount option ("" when it is)."""
    if not _FLAG_RE.fullmatch(flag):
        return "expected one mount option of letters, digits and '_.:+-' (a value may add '/@')"
    name = flag.split("=", 1)[0].lower()
    if name in _KIND_FLAGS or name.startswith("make-"):
        return "changes the kind of mount or its propagation, which the driver decides"
    if name in _WHO_FLAGS or name.startswith("x-"):
        return "changes who may use, mount or unmount the volume (or runs a helper): not allowed"
    return ""


def checked_flags(flags: Iterable[str], field: str = "volume_capability.mount.mount_flags") -> tuple[str, ...]:
    """The mount flags as given, when every one is acceptable; INVALID_ARGUMENT naming the first that is not."""
    out = []
    for i, f in enumerate(flags):
        why = flag_problem(f)
        if why:
            raise InvalidArgument(f"{field}[{i}]: {why}, got {f[:128]!r}")
        out.append(str(f))
    return tuple(out)
