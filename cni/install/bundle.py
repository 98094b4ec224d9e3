"""The CNI entry point on the host: one self-contained bundle per build under ``nodeplug.d/<id>/`` and the
``nodeplug`` symlink the runtime execs, replaced so that an exec sees the old build or the new one, never a
half-copied file (see :mod:`cni.install`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cni import thick
from cni.install import refplugins
from cni.install.errors import InstallError
from nodeplug import commands
from nodeplug.fsutil import fsync_dir, write_atomic

LINK_NAME = "nodeplug"
BUNDLE_DIR = "nodeplug.d"
LAUNCHER = "nodeplug"
DEFAULT_BUNDLE = "/opt/nodeplug/cni-bundle"
SMOKE_CNI_VERSION = "1.0.0"
SMOKE_TIMEOUT = 20.0


@dataclass(frozen=True)
class Layout:
    bin_dir: Path
    conf_dir: Path
    conflist_name: str

    @property
    def link(self) -> Path:
        return self.bin_dir / LINK_NAME

    @property
    def bundles(self) -> Path:
        return self.bin_dir / BUNDLE_DIR

    @property
    def conflist(self) -> Path:
        return self.conf_dir / self.conflist_name

    @property
    def socket_record(self) -> Path:
        """Where the launcher reads the agent socket of the installed conflist (it parses no JSON)."""
        return self.bundles / thick.SOCKET_RECORD


# ---------------------------------------------------------------- small atomic helpers


def _symlink_atomic(target: str, link: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def bundle_id(bundle: Path) -> str:
    """A hash of the bundle's tree: relative paths, file types, executable bits, contents and symlink targets."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(bundle):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            p = Path(dirpath) / name
            rel = p.relative_to(bundle).as_posix()
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                h.update(f"L {rel} {os.readlink(p)}\n".encode())
            elif stat.S_ISREG(st.st_mode):
                h.update(f"F {rel} {st.st_mode & 0o111 != 0} {st.st_size}\n".encode())
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
    return h.hexdigest()[:16]


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy files, directories and symlinks of ``src`` into the new directory ``dst``; every file synced."""
    dst.mkdir(mode=0o755)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        for name in list(dirnames):
            s, d = Path(dirpath) / name, dst / rel / name
            if s.is_symlink():
                os.symlink(os.readlink(s), d)
                dirnames.remove(name)
            else:
                d.mkdir(mode=0o755)
        for name in filenames:
            s, d = Path(dirpath) / name, dst / rel / name
            if s.is_symlink():
                os.symlink(os.readlink(s), d)
                continue
            mode = 0o755 if os.access(s, os.X_OK) else 0o644
            with open(s, "rb") as fi, open(d, "xb") as fo:
                shutil.copyfileobj(fi, fo, 1 << 20)
                fo.flush()
                os.fsync(fo.fileno())
            os.chmod(d, mode)
    for dirpath, _, _ in os.walk(dst):
        fsync_dir(Path(dirpath))


def _link_target(layout: Layout) -> str | None:
    """Where ``nodeplug`` points inside nodeplug.d/ (``<id>``), None when absent; error when it is not ours."""
    link = layout.link
    if not link.is_symlink():
        if link.exists():
            raise InstallError(
                f"{link}: exists and was not installed by nodeplug install-cni (not a symlink into {BUNDLE_DIR}/); "
                "remove it or pass --force"
            )
        return None
    parts = Path(os.readlink(link)).parts
    if len(parts) != 3 or parts[0] != BUNDLE_DIR or parts[2] != LAUNCHER:
        raise InstallError(f"{link}: points to {os.readlink(link)}, not into {BUNDLE_DIR}/; remove it or pass --force")
    return parts[1]


def _smoke_test(launcher: Path) -> None:
    """Run the new build once as a runtime would (VERSION) before anything points at it."""
    try:
        out = commands.run(
            ["env", "-i", "CNI_COMMAND=VERSION", str(launcher)], SMOKE_TIMEOUT, input=b'{"cniVersion":"1.0.0"}'
        )
        versions = json.loads(out).get("supportedVersions")
    except (commands.CommandError, ValueError, AttributeError) as e:
        raise InstallError(f"{launcher}: the new CNI bundle does not answer VERSION: {e}") from None
    if not isinstance(versions, list) or SMOKE_CNI_VERSION not in versions:
        raise InstallError(f"{launcher}: unexpected VERSION answer {out.strip()!r}")


def remove_leftovers(layout: Layout) -> None:
    """Temp files and directories of an install that crashed (only names this module makes)."""
    for stale in layout.bundles.glob(".tmp-*") if layout.bundles.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)
    for stale in layout.bundles.glob(f".{thick.SOCKET_RECORD}.*.tmp") if layout.bundles.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    patterns = [(f".{LINK_NAME}.tmp-*", layout.bin_dir), *((f".{n}.*.tmp", layout.bin_dir) for n in refplugins.PLUGINS)]
    for pattern, d in [*patterns, (f".{layout.conflist_name}.tmp-*", layout.conf_dir)]:
        for stale in d.glob(pattern) if d.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
    for stale in layout.bin_dir.glob(f".{BUNDLE_DIR}.removing-*") if layout.bin_dir.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)


def install_bundle(bundle: Path, layout: Layout, force: bool = False, say: Callable[[str], None] = print) -> bool:
    """Install ``bundle`` as ``<bin>/nodeplug``; True when something changed."""
    if not (bundle / LAUNCHER).is_file() or not os.access(bundle / LAUNCHER, os.X_OK):
        raise InstallError(
            f"{bundle}: not a CNI bundle (no executable {LAUNCHER}); build one with scripts/build-cni-bundle "
            "or pass --bundle DIR"
        )
    layout.bin_dir.mkdir(parents=True, exist_ok=True)
    try:
        current = _link_target(layout)
    except InstallError:
        if not force:
            raise
        current = None
    bid = bundle_id(bundle)
    layout.bundles.mkdir(mode=0o755, exist_ok=True)
    remove_leftovers(layout)
    dest = layout.bundles / bid
    changed = False
    damaged = dest.exists() and bundle_id(dest) != bid  # changed by hand: replace it with a good copy
    if damaged or not dest.exists():
        tmp = layout.bundles / f".tmp-{bid}-{os.getpid()}"
        try:
            _copy_tree(bundle, tmp)
            if damaged:
                aside = layout.bundles / f".tmp-damaged-{bid}-{os.getpid()}"
                os.rename(dest, aside)
                os.rename(tmp, dest)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(layout.bundles)
        say(f"{'repaired' if damaged else 'copied'} {dest}")
        changed = True
    _smoke_test(dest / LAUNCHER)
    if current != bid:
        _symlink_atomic(f"{BUNDLE_DIR}/{bid}/{LAUNCHER}", layout.link)
        say(f"installed {layout.link} -> {BUNDLE_DIR}/{bid}/{LAUNCHER}")
        changed = True
    else:
        say(f"unchanged {layout.link} -> {BUNDLE_DIR}/{bid}/{LAUNCHER}")
    keep = {bid, current, thick.SOCKET_RECORD}
    for old in layout.bundles.iterdir():
        if old.name not in keep and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
            say(f"removed old build {old}")
    return changed


def record_socket(layout: Layout, socket: str, say: Callable[[str], None] = print) -> bool:
    """Tell the launcher which agent socket the installed conflist names (one line, written atomically); True when it
    changed."""
    data = f"{socket}\n".encode()
    path = layout.socket_record
    if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
        return False
    write_atomic(path, data)
    say(f"recorded the agent socket {socket} in {path}")
    return True


def remove_bundle(layout: Layout, say: Callable[[str], None] = print) -> bool:
    """Remove the symlink (when it points into nodeplug.d/) and nodeplug.d/; True when something was removed."""
    changed = False
    try:
        if _link_target(layout) is not None:
            layout.link.unlink()
            say(f"removed {layout.link}")
            changed = True
    except InstallError as e:
        say(f"left {layout.link} in place: {e}")
    if layout.bundles.is_dir() and not layout.bundles.is_symlink():
        doomed = layout.bin_dir / f".{BUNDLE_DIR}.removing-{os.getpid()}"
        os.rename(layout.bundles, doomed)
        shutil.rmtree(doomed)
        say(f"removed {layout.bundles}")
        changed = True
    return changed
