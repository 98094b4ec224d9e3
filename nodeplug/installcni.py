"""``nodeplug install-cni [--uninstall]``: put the CNI entry point and its conflist on the host, and take them away.

What it owns on the host (paths under ``--root``, default ``/``)::

    /opt/cni/bin/nodeplug            symlink -> nodeplug.d/<id>/nodeplug   (what the runtime execs)
    /opt/cni/bin/nodeplug.d/<id>/    one self-contained bundle per installed build (scripts/build-cni-bundle);
                                     <id> is a hash of its content, so the same build installs to the same place
    /etc/cni/net.d/10-nodeplug.conflist

Install is atomic at every step a runtime can observe: the bundle is copied into ``nodeplug.d/.tmp-<id>-<pid>``,
synced, and renamed to ``nodeplug.d/<id>``; it is run once (``CNI_COMMAND=VERSION``) before anything points at it;
then a new symlink is renamed over ``nodeplug``, so an exec sees the old build or the new one, never a half-copied
file. The build the symlink pointed at before stays (a plugin still running from it keeps its files); older builds
are removed. The conflist is written to a temp name the runtime ignores and renamed into place. Running it again
with the same inputs changes nothing. A crash at any point leaves either the old or the new state plus, at worst,
a ``.tmp-*`` directory, which the next run removes. One install runs at a time on a host: the DaemonSet has one pod
per node and replaces it without surge.

It never touches files it did not write: an existing ``nodeplug`` that is not a symlink into ``nodeplug.d/``, or a
conflist of that name without a ``"type": "nodeplug"`` plugin, stops the install with an error (``--force`` takes
them over). ``--uninstall`` removes exactly the symlink, ``nodeplug.d/``, our conflist and the reference plugins it
copied, and, in the node's network namespace, what nodeplug's networks left there (:mod:`nodeplug.cninetwork`:
the unused pod bridge and masquerade table, and the cluster network, which the running agent is asked to give up
until the next install), and nothing else.

Reference plugins: container runtimes exec ``loopback`` for every pod sandbox (containerd's CRI fails the sandbox
without it) and a conflist may chain ``portmap``. When the bin dir lacks them they are copied from
``--reference-plugins`` (the image's Debian containernetworking-plugins, ``/usr/lib/cni``) by
:mod:`nodeplug.refplugins`, which never overwrites or removes a host's own copy.

The conflist is generated from the flags (bridge, subnets or the cluster network's node subnets, masquerade) or taken
from ``--conflist-file``; either way every nodeplug plugin in it is checked with the same parser the entry point uses
before the host is touched. ``--cluster-network`` makes the conflist of the cluster pod network: IPAM ranges from this
node's podCIDRs (``ipam.nodeSubnets``, the file the agent keeps) and no per-pod masquerade (the agent masquerades
traffic leaving the cluster CIDRs, so pod-to-pod traffic keeps its source address).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import json
import os
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeplug import cninetwork, commands, refplugins
from nodeplug.fsutil import fsync_dir, write_atomic
from nodeplug.paths import CNI_BIN_DIR, CNI_CONF_DIR, Root

PLUGIN_TYPE = "nodeplug"
LINK_NAME = "nodeplug"
BUNDLE_DIR = "nodeplug.d"
LAUNCHER = "nodeplug"
DEFAULT_BUNDLE = "/opt/nodeplug/cni-bundle"
DEFAULT_CONFLIST = "10-nodeplug.conflist"
DEFAULT_NETWORK = "nodeplug"
DEFAULT_BRIDGE = "nodeplug0"
DEFAULT_SUBNET = "10.222.0.0/16"
DEFAULT_NODE_SUBNETS = cninetwork.DEFAULT_SUBNETS
DEFAULT_CNI_VERSION = "1.0.0"
CNI_VERSIONS = ("0.4.0", "1.0.0", "1.1.0")
SMOKE_TIMEOUT = 20.0


class InstallError(Exception):
    """Install or uninstall refused or failed; the message names the path at fault and what to do."""

    exit_status = 1


class InputError(InstallError):
    """A flag or the given conflist is invalid (exit status 2); nothing on the host was touched."""

    exit_status = 2


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


# ---------------------------------------------------------------- conflist


def _subnet(text: str) -> str:
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected a network like 10.222.0.0/16 or fd22::/64, got {text!r} ({e})"
        ) from None
    return str(net)


def generate_conflist(args: argparse.Namespace) -> dict[str, Any]:
    """The conflist for the flags: nodeplug as the main plugin with its own IPAM, one range set per subnet (or, for
    the cluster network, per podCIDR of the node)."""
    if args.cluster_network:
        if args.subnet:
            raise InputError("--subnet and --cluster-network exclude each other (the node's podCIDRs are its subnets)")
        ipam: dict[str, Any] = {"type": PLUGIN_TYPE, "nodeSubnets": args.node_subnets}
    else:
        ipam = {"type": PLUGIN_TYPE, "ranges": [[{"subnet": s}] for s in (args.subnet or [DEFAULT_SUBNET])]}
    plugin: dict[str, Any] = {
        "type": PLUGIN_TYPE,
        "bridge": args.bridge,
        "isGateway": True,
        "isDefaultGateway": True,
        "ipMasq": args.ip_masq and not args.cluster_network,
        "hairpinMode": True,
        "ipam": ipam,
    }
    if args.mtu is not None:
        plugin["mtu"] = args.mtu
    if args.socket is not None:
        plugin["socket"] = args.socket
    if args.ipam_data_dir is not None:
        plugin["ipam"]["dataDir"] = args.ipam_data_dir
    plugins = [plugin]
    if args.portmap:
        plugins.append({"type": "portmap", "capabilities": {"portMappings": True}})
    return {"cniVersion": args.cni_version, "name": args.network_name, "plugins": plugins}


def check_conflist(conf: Any, source: str) -> None:
    """Check a conflist's shape, and every nodeplug plugin in it as the entry point will parse it."""
    if not isinstance(conf, dict):
        raise InputError(f"{source}: expected a JSON object (a conflist), got {type(conf).__name__}")
    for key in ("cniVersion", "name"):
        if not isinstance(conf.get(key), str) or not conf[key]:
            raise InputError(f"{source}: {key}: expected a non-empty string, got {conf.get(key)!r}")
    plugins = conf.get("plugins")
    if not isinstance(plugins, list) or not plugins or not all(isinstance(p, dict) for p in plugins):
        raise InputError(f"{source}: plugins: expected a non-empty list of plugin objects")
    if not is_ours(conf):
        raise InstallError(f'{source}: plugins: expected a plugin with "type": "{PLUGIN_TYPE}"')
    try:
        from cni.errors import CniError
        from cni.netconf import parse
    except ImportError:  # pragma: no cover - the CNI package ships with this distribution
        return
    for i, p in enumerate(plugins):
        ipam = p.get("ipam")
        if p.get("type") != PLUGIN_TYPE and not (isinstance(ipam, dict) and ipam.get("type") == PLUGIN_TYPE):
            continue
        try:
            parse({**p, "cniVersion": conf["cniVersion"], "name": conf["name"]})
        except CniError as e:
            raise InputError(f"{source}: plugins[{i}]: {e.msg}: {e.details}") from None


def is_ours(conf: Any) -> bool:
    plugins = conf.get("plugins") if isinstance(conf, dict) else None
    return isinstance(plugins, list) and any(isinstance(p, dict) and p.get("type") == PLUGIN_TYPE for p in plugins)


def _read_conflist(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- install / uninstall


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
    if not isinstance(versions, list) or DEFAULT_CNI_VERSION not in versions:
        raise InstallError(f"{launcher}: unexpected VERSION answer {out.strip()!r}")


def _remove_leftovers(layout: Layout) -> None:
    """Temp files and directories of an install that crashed (only names this module makes)."""
    for stale in layout.bundles.glob(".tmp-*") if layout.bundles.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)
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
    _remove_leftovers(layout)
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
    keep = {bid, current}
    for old in layout.bundles.iterdir():
        if old.name not in keep and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
            say(f"removed old build {old}")
    return changed


def install_conflist(
    conf: dict[str, Any], layout: Layout, force: bool = False, say: Callable[[str], None] = print
) -> bool:
    data = (json.dumps(conf, indent=2) + "\n").encode()
    path = layout.conflist
    if path.exists():
        if path.read_bytes() == data:
            say(f"unchanged {path}")
            return False
        if not is_ours(_read_conflist(path)) and not force:
            raise InstallError(
                f'{path}: exists and has no "type": "{PLUGIN_TYPE}" plugin (not ours); choose another '
                "--conflist-name or pass --force"
            )
    layout.conf_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    say(f"installed {path}")
    return True


def uninstall(layout: Layout, say: Callable[[str], None] = print, network: bool = False) -> bool:
    """Remove the symlink, nodeplug.d/, our conflist and our copies of the reference plugins; leave anything that is
    not ours (and say so). With ``network`` (this node's own paths, not a --root), also the network's bridge and
    masquerade table if unused."""
    _remove_leftovers(layout)
    changed = refplugins.uninstall(layout.bin_dir, layout.bin_dir / refplugins.RECORD, say)
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
    if layout.conflist.exists():
        conf = _read_conflist(layout.conflist)
        if is_ours(conf):
            if network:
                cninetwork.remove_unused(conf, DEFAULT_BRIDGE, say)
            layout.conflist.unlink()
            say(f"removed {layout.conflist}")
            changed = True
        else:
            say(f"left {layout.conflist} in place: it has no nodeplug plugin")
    if changed:
        for d in (layout.bin_dir, layout.conf_dir):
            if d.is_dir():
                fsync_dir(d)
    else:
        say("nothing to remove: nodeplug's CNI entry point is not installed")
    return changed


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Install the CNI entry point (a self-contained bundle) and its conflist on the host."
    parser.add_argument("--uninstall", action="store_true", help="remove what install-cni installed, and only that")
    parser.add_argument("--root", type=Path, default=Path("/"), help="host root the paths are under (default /)")
    parser.add_argument(
        "--bundle", type=Path, default=Path(os.environ.get("NODEPLUG_CNI_BUNDLE", DEFAULT_BUNDLE)),
        help=f"the bundle built by scripts/build-cni-bundle (default $NODEPLUG_CNI_BUNDLE or {DEFAULT_BUNDLE})",
    )  # fmt: skip
    parser.add_argument("--bin-dir", default=CNI_BIN_DIR, help=f"CNI plugin directory (default {CNI_BIN_DIR})")
    parser.add_argument("--conf-dir", default=CNI_CONF_DIR, help=f"CNI config directory (default {CNI_CONF_DIR})")
    parser.add_argument(
        "--conflist-name", default=DEFAULT_CONFLIST,
        help=f"file name in the config directory; runtimes use the first in lexical order (default {DEFAULT_CONFLIST})",
    )  # fmt: skip
    parser.add_argument("--skip-conflist", action="store_true", help="install the entry point only")
    parser.add_argument(
        "--reference-plugins", type=Path, default=Path(refplugins.SOURCE), metavar="DIR",
        help=f"loopback and portmap are copied from here when the bin dir lacks them (default {refplugins.SOURCE})",
    )  # fmt: skip
    parser.add_argument(
        "--cluster-network", action="store_true",
        help="the cluster pod network's conflist: ranges from this node's podCIDRs, masquerade left to the agent",
    )  # fmt: skip
    parser.add_argument(
        "--node-subnets", default=DEFAULT_NODE_SUBNETS, metavar="FILE",
        help=f"with --cluster-network: where the agent keeps this node's podCIDRs (default {DEFAULT_NODE_SUBNETS})",
    )  # fmt: skip
    parser.add_argument("--portmap", action="store_true", help="chain the reference portmap plugin (hostPort)")
    parser.add_argument("--conflist-file", type=Path, help="install this conflist instead of generating one")
    parser.add_argument("--network-name", default=DEFAULT_NETWORK, help=f"network name (default {DEFAULT_NETWORK})")
    parser.add_argument("--cni-version", default=DEFAULT_CNI_VERSION, choices=CNI_VERSIONS, help="conflist cniVersion")
    parser.add_argument("--bridge", default=DEFAULT_BRIDGE, help=f"bridge name (default {DEFAULT_BRIDGE})")
    parser.add_argument(
        "--subnet", action="append", type=_subnet, metavar="CIDR",
        help=f"pod subnet; repeat for dual stack (default {DEFAULT_SUBNET})",
    )  # fmt: skip
    parser.add_argument("--mtu", type=int, choices=range(68, 65536), metavar="MTU", help="pod interface MTU")
    parser.add_argument(
        "--no-ip-masq", dest="ip_masq", action="store_false", help="do not masquerade pod traffic leaving the node"
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="the agent's CNI socket (the agent config's cni.socket; default /run/nodeplug/cni.sock)",
    )
    parser.add_argument(
        "--ipam-data-dir", metavar="DIR", help="where leases are kept on the host (default /var/lib/nodeplug/ipam)"
    )
    parser.add_argument("--force", action="store_true", help="take over a nodeplug file or conflist not written here")


def _layout(args: argparse.Namespace) -> Layout:
    root = Root(args.root.resolve())
    name = args.conflist_name
    if "/" in name or not name.endswith((".conflist", ".conf", ".json")) or name.startswith("."):
        raise InputError(f"--conflist-name: expected a file name ending in .conflist, got {name!r}")
    return Layout(root(args.bin_dir), root(args.conf_dir), name)


def run_install(args: argparse.Namespace) -> int:
    layout, root = _layout(args), Root(args.root.resolve())
    if args.uninstall:
        uninstall(layout, network=cninetwork.on_this_node(root))
        cninetwork.remove_cluster_network(root, print)
        return 0
    conf: dict[str, Any] | None = None
    if not args.skip_conflist:
        if args.conflist_file is not None:
            try:
                conf = json.loads(args.conflist_file.read_text())
            except OSError as e:
                raise InputError(f"{args.conflist_file}: cannot read: {e.strerror}") from None
            except ValueError as e:
                raise InputError(f"{args.conflist_file}: not valid JSON: {e}") from None
            check_conflist(conf, str(args.conflist_file))
        else:
            conf = generate_conflist(args)
            check_conflist(conf, "generated conflist")
    install_bundle(args.bundle, layout, args.force)
    refplugins.install(args.reference_plugins, layout.bin_dir, layout.bin_dir / refplugins.RECORD)
    if conf is not None:
        install_conflist(conf, layout, args.force)
    cninetwork.withdraw_uninstall(root, print)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return run_install(args)
    except (InstallError, cninetwork.NetworkError) as e:
        print(f"nodeplug install-cni: {e}", file=sys.stderr)
        return e.exit_status if isinstance(e, InstallError) else 1
    except OSError as e:
        print(f"nodeplug install-cni: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 1
