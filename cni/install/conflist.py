"""The network config ``install-cni`` writes: generated from the flags or given as a file, and checked with the same
parser the entry point uses before the host is touched (see :mod:`cni.install`)."""

from __future__ import annotations

import argparse
import ipaddress
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cni.errors import CniError
from cni.install.bundle import Layout
from cni.install.errors import InputError, InstallError
from cni.netconf import parse
from nodeplug.fsutil import write_atomic

PLUGIN_TYPE = "nodeplug"
DEFAULT_CONFLIST = "10-nodeplug.conflist"
DEFAULT_NETWORK = "nodeplug"
DEFAULT_BRIDGE = "nodeplug0"
DEFAULT_SUBNET = "10.222.0.0/16"
DEFAULT_CNI_VERSION = "1.0.0"
CNI_VERSIONS = ("0.4.0", "1.0.0", "1.1.0")


def subnet_arg(text: str) -> str:
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected a network like 10.222.0.0/16 or fd22::/64, got {text!r} ({e})"
        ) from None
    return str(net)


def generate_conflist(args: argparse.Namespace) -> dict[str, Any]:
    """The conflist for the flags: nodeplug as the main plugin with its own IPAM, one range set per subnet (or, for
    the cluster network, per podCIDR of the node), on ``args.datapath``."""
    if args.cluster_network:
        if args.subnet:
            raise InputError("--subnet and --cluster-network exclude each other (the node's podCIDRs are its subnets)")
        ipam: dict[str, Any] = {"type": PLUGIN_TYPE, "nodeSubnets": args.node_subnets}
    else:
        ipam = {"type": PLUGIN_TYPE, "ranges": [[{"subnet": s}] for s in (args.subnet or [DEFAULT_SUBNET])]}
    plugin: dict[str, Any] = {
        "type": PLUGIN_TYPE,
        "datapath": args.datapath,
        # routed: no bridge is made; it stays named so that the uninstall removes the bridge of an earlier bridge
        # datapath once its last pod is gone
        "bridge": args.bridge,
        "isGateway": True,
        "isDefaultGateway": True,
        "ipMasq": args.ip_masq and not args.cluster_network,
        "ipam": ipam,
    }
    if args.datapath == "bridge":
        plugin["hairpinMode"] = True
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


def read_conflist(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def install_conflist(
    conf: dict[str, Any], layout: Layout, force: bool = False, say: Callable[[str], None] = print
) -> bool:
    data = (json.dumps(conf, indent=2) + "\n").encode()
    path = layout.conflist
    if path.exists():
        if path.read_bytes() == data:
            say(f"unchanged {path}")
            return False
        if not is_ours(read_conflist(path)) and not force:
            raise InstallError(
                f'{path}: exists and has no "type": "{PLUGIN_TYPE}" plugin (not ours); choose another '
                "--conflist-name or pass --force"
            )
    layout.conf_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    say(f"installed {path}")
    return True
