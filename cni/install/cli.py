"""``nodeplug install-cni [--uninstall]``: the command (see :mod:`cni.install` for what it owns on the host)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cni import thick
from cni.install import bundle, network, refplugins
from cni.install.bundle import Layout
from cni.install.conflist import (
    CNI_VERSIONS,
    DEFAULT_BRIDGE,
    DEFAULT_CNI_VERSION,
    DEFAULT_CONFLIST,
    DEFAULT_NETWORK,
    DEFAULT_SUBNET,
    check_conflist,
    generate_conflist,
    install_conflist,
    is_ours,
    read_conflist,
    subnet_arg,
)
from cni.install.errors import InputError, InstallError
from cni.netconf import DATAPATHS
from cni.nodesubnets import DEFAULT_PATH as DEFAULT_NODE_SUBNETS
from nodeplug.config import AgentConfig, ConfigError, load
from nodeplug.fsutil import fsync_dir
from nodeplug.paths import CNI_BIN_DIR, CNI_CONF_DIR, Root


def uninstall(layout: Layout, say: Callable[[str], None] = print, on_node: bool = False) -> bool:
    """Remove the symlink, nodeplug.d/, our conflist and our copies of the reference plugins; leave anything that is
    not ours (and say so). ``on_node`` (this process runs in the node's network namespace): also the network's
    bridge and masquerade table if unused."""
    bundle.remove_leftovers(layout)
    changed = refplugins.uninstall(layout.bin_dir, layout.bin_dir / refplugins.RECORD, say)
    changed = bundle.remove_bundle(layout, say) or changed
    if layout.conflist.exists():
        conf = read_conflist(layout.conflist)
        if is_ours(conf):
            if on_node:
                network.remove_unused(conf, DEFAULT_BRIDGE, say)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Install the CNI entry point (a self-contained bundle) and its conflist on the host."
    parser.add_argument("--uninstall", action="store_true", help="remove what install-cni installed, and only that")
    parser.add_argument("--root", type=Path, default=Path("/"), help="host root the paths are under (default /)")
    parser.add_argument(
        "--bundle", type=Path, default=Path(os.environ.get("NODEPLUG_CNI_BUNDLE", bundle.DEFAULT_BUNDLE)),
        help=f"the bundle built by scripts/build-cni-bundle (default $NODEPLUG_CNI_BUNDLE or {bundle.DEFAULT_BUNDLE})",
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
    parser.add_argument(
        "--datapath", choices=DATAPATHS,
        help=f"how pods are attached: routed (a veth per pod, a host route each; no bridge) or bridge (default: the "
        f"agent config's cni.datapath, from --config, $NODEPLUG_CONFIG or {AGENT_CONFIG} when it exists; else routed)",
    )  # fmt: skip
    parser.add_argument("--bridge", default=DEFAULT_BRIDGE, help=f"bridge name (default {DEFAULT_BRIDGE})")
    parser.add_argument(
        "--subnet", action="append", type=subnet_arg, metavar="CIDR",
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
    parser.add_argument(
        "--config", type=Path, metavar="FILE",
        help=f"the agent config: its cni.datapath is the default of --datapath; with --uninstall, its cluster_network "
        f"route protocol and subnets file are removed (default $NODEPLUG_CONFIG, else {AGENT_CONFIG} when it exists, "
        "else the built-in defaults)",
    )  # fmt: skip


AGENT_CONFIG = "/etc/nodeplug/agent.yaml"  # where the DaemonSet's agent container has it


def _agent_config(args: argparse.Namespace) -> AgentConfig:
    """The agent config the uninstall takes the cluster network's route protocol and subnets file from: never a
    record the last agent left on the host."""
    path = args.config or (Path(p) if (p := os.environ.get("NODEPLUG_CONFIG")) else None)
    if path is None and Path(AGENT_CONFIG).is_file():
        path = Path(AGENT_CONFIG)
    try:
        return load(path)
    except ConfigError as e:
        raise InputError(str(e)) from None


def _layout(args: argparse.Namespace) -> Layout:
    root = Root(args.root.resolve())
    name = args.conflist_name
    if "/" in name or not name.endswith((".conflist", ".conf", ".json")) or name.startswith("."):
        raise InputError(f"--conflist-name: expected a file name ending in .conflist, got {name!r}")
    return Layout(root(args.bin_dir), root(args.conf_dir), name)


def run_install(args: argparse.Namespace) -> int:
    layout, root = _layout(args), Root(args.root.resolve())
    if args.uninstall:
        cluster = _agent_config(args).cluster_network
        uninstall(layout, on_node=network.on_this_node(root))
        network.remove_cluster_network(root, print, None, cluster.route_protocol, cluster.subnets_file)
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
            if args.datapath is None:
                args.datapath = _agent_config(args).cni.datapath
            conf = generate_conflist(args)
            check_conflist(conf, "generated conflist")
    bundle.install_bundle(args.bundle, layout, args.force)
    bundle.record_socket(layout, _agent_socket(conf, args.socket))
    refplugins.install(args.reference_plugins, layout.bin_dir, layout.bin_dir / refplugins.RECORD)
    if conf is not None:
        install_conflist(conf, layout, args.force)
    network.withdraw_uninstall(root, print)
    return 0


def _agent_socket(conf: dict[str, Any] | None, flag: str | None) -> str:
    """The socket the launcher asks first: the one the installed conflist's first nodeplug plugin names, else
    ``--socket``, else the default."""
    plugins = conf.get("plugins") if conf is not None else None
    for p in plugins if isinstance(plugins, list) else ():
        if isinstance(p, dict) and p.get("type") == "nodeplug":
            where = thick.route(p)
            if where is not None:
                return where[0]
    return flag or thick.DEFAULT_SOCKET


def run(args: argparse.Namespace) -> int:
    try:
        return run_install(args)
    except (InstallError, network.NetworkError) as e:
        print(f"nodeplug install-cni: {e}", file=sys.stderr)
        return e.exit_status if isinstance(e, InstallError) else 1
    except OSError as e:
        print(f"nodeplug install-cni: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 1
