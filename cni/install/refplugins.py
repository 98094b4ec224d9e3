"""The reference CNI plugins ``nodeplug install-cni`` puts on a host that lacks them: ``loopback`` and ``portmap``.

Container runtimes exec ``loopback`` for every pod sandbox (containerd's CRI fails the sandbox without it, whatever
the main plugin did) and a conflist may chain ``portmap`` for hostPorts. The image carries Debian's
containernetworking-plugins in ``/usr/lib/cni``; each missing plugin is copied into the bin dir atomically
(:func:`nodeplug.fsutil.write_atomic`) and its hash recorded in ``.nodeplug-reference-plugins.json`` beside them. A
copy is replaced or removed only while it is still byte for byte the one recorded: a host's own ``loopback`` or
``portmap`` (present before, or put there later) is never overwritten or deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from nodeplug.fsutil import write_atomic

PLUGINS = ("loopback", "portmap")
SOURCE = "/usr/lib/cni"
RECORD = ".nodeplug-reference-plugins.json"  # in the bin dir, beside them


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read(record: Path) -> dict[str, str]:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if k in PLUGINS and isinstance(v, str)}


def _ours(path: Path, record: dict[str, str]) -> bool | None:
    """True: the copy we recorded; False: someone else's file; None: nothing there."""
    if not path.exists() and not path.is_symlink():
        return None
    return path.is_file() and not path.is_symlink() and record.get(path.name) == _sha256(path)


def install(src: Path, bin_dir: Path, record_path: Path, say: Callable[[str], None] = print) -> bool:
    """Copy each plugin from ``src`` where ``bin_dir`` has none (or only our older copy); True when one changed."""
    record = _read(record_path)
    before = dict(record)
    changed = False
    for name in PLUGINS:
        source, dest = src / name, bin_dir / name
        if not source.is_file():
            say(f"no {source}: {name} not installed (the image ships Debian's containernetworking-plugins)")
            continue
        ours = _ours(dest, record)
        if ours is False:
            say(f"left {dest} in place: the host's own")
            record.pop(name, None)
            continue
        data = source.read_bytes()  # a few MiB: hashed and copied from one read
        want = hashlib.sha256(data).hexdigest()
        if ours and record.get(name) == want:
            say(f"unchanged {dest}")
            continue
        write_atomic(dest, data, 0o755)
        record[name] = want
        say(f"installed {dest} (from {source})")
        changed = True
    if record != before:
        record_path.parent.mkdir(mode=0o755, exist_ok=True)
        write_atomic(record_path, (json.dumps(record, sort_keys=True) + "\n").encode())
    return changed


def uninstall(bin_dir: Path, record_path: Path, say: Callable[[str], None] = print) -> bool:
    """Remove our copies (those still exactly as recorded); True when one was removed."""
    record = _read(record_path)
    changed = False
    for name in sorted(record):
        dest = bin_dir / name
        if _ours(dest, record):
            dest.unlink()
            say(f"removed {dest}")
            changed = True
        elif dest.exists():
            say(f"left {dest} in place: changed since nodeplug install-cni put it there")
    with contextlib.suppress(FileNotFoundError):
        record_path.unlink()
    return changed
