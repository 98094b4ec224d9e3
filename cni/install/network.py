"""What nodeplug's networks leave in the node's network namespace, removed by ``nodeplug install-cni --uninstall``.

The CNI plugin's: the bridge a nodeplug network names (created at the first ADD, kept while pods are attached) and
nodeplug's masquerade table (``table inet nodeplug``, one rule per pod address): DEL of the last pod removes its veth
and its rules but neither of these, since another pod may come. They are removed when unused: a bridge only when it
is a bridge with no interface attached, the table only when it holds no rule (a concurrent ADD finding it gone
declares it again).

The cluster network's (routes, VXLAN device, masquerade table, subnets file): the running agent keeps them through
restarts, so the uninstall asks it to stand down and remove them, waits for it, and then runs the same removal
itself (:mod:`cni.cluster.uninstall`, :mod:`cni.cluster.teardown`): that does the work when no agent is running and
finds nothing left when one did. The request stays until the next ``install-cni`` withdraws it, so an agent started
in between (a crash loop, a node reboot before ``kubectl delete``) does not bring the network back.

Kernel objects are removed only in the node's network namespace: the one the agent of this root recorded, or, with
no record, this one when the root is ``/`` (``install-cni`` run on the node or in the host-network agent pod).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cni.dataplane.names import BRIDGE_ALIAS
from cni.nodesubnets import DEFAULT_PATH as DEFAULT_SUBNETS
from nodeplug import commands
from nodeplug.paths import Root

MASQ_TABLE = ("inet", "nodeplug")
TIMEOUT = 10.0
AGENT_TIMEOUT = 30.0  # for the running agent to finish its pass and remove the cluster network (milliseconds, usually)
DEFAULT_PROTOCOL = 110  # cluster_network.route_protocol's default


class NetworkError(Exception):
    """The cluster network could not be taken off the node; the message says what is left and what to do."""


def bridges(conf: Any, default: str) -> list[str]:
    """The bridges the nodeplug plugins of a conflist use."""
    plugins = conf.get("plugins", []) if isinstance(conf, dict) else []
    return [str(p.get("bridge") or default) for p in plugins if isinstance(p, dict) and p.get("type") == "nodeplug"]


def _ip_json(*args: str) -> list[dict[str, Any]]:
    out = commands.run(["ip", "-j", *args], TIMEOUT).strip()
    return list(json.loads(out)) if out else []


def remove_bridge(name: str, say: Callable[[str], None]) -> None:
    try:
        links = _ip_json("-d", "link", "show", "dev", name)
    except commands.CommandError:
        return  # not there
    if not links or links[0].get("linkinfo", {}).get("info_kind") != "bridge":
        say(f"left {name} in place: not a bridge")
        return
    if links[0].get("ifalias") != BRIDGE_ALIAS:
        say(f"left bridge {name} in place: nodeplug did not create it (no alias {BRIDGE_ALIAS!r})")
        return
    ports = [p["ifname"] for p in _ip_json("link", "show", "master", name)]
    if ports:
        say(f"left bridge {name} in place: pods are still attached ({', '.join(ports)})")
        return
    commands.run(["ip", "link", "delete", name, "type", "bridge"], TIMEOUT)
    say(f"removed bridge {name}")


def remove_masq_table(say: Callable[[str], None]) -> None:
    family, table = MASQ_TABLE
    try:
        listing = json.loads(commands.run(["nft", "-j", "list", "table", family, table], TIMEOUT))
    except commands.CommandError:
        return  # no table (or no nftables on this node)
    rules = [o for o in listing.get("nftables", []) if "rule" in o]
    if rules:
        say(f"left nftables table {family} {table} in place: it still masquerades {len(rules)} pod address(es)")
        return
    commands.run(["nft", "delete", "table", family, table], TIMEOUT)
    say(f"removed nftables table {family} {table}")


def remove_policy_tables(say: Callable[[str], None]) -> None:
    """Network policy's tables (cni.policy): with the workloads gone, nothing is left for them to protect."""
    from cni.policy import kernel, quarantine
    from cni.policy.ruleset import TABLE

    try:
        if kernel.remove():
            say(f"removed nftables table inet {TABLE}")
        if quarantine.remove():
            say(f"removed nftables table inet {quarantine.TABLE}")
    except (kernel.KernelError, quarantine.QuarantineError) as e:
        say(f"left network policy's tables in place: {e}")


def remove_unused(conf: Any, default_bridge: str, say: Callable[[str], None]) -> None:
    """Remove the conflist's bridges and nodeplug's masquerade table if unused; failures are reported, not raised."""
    try:
        for name in bridges(conf, default_bridge):
            remove_bridge(name, say)
        remove_masq_table(say)
        remove_policy_tables(say)
    except commands.CommandError as e:
        say(f"left the network in place: {e}")


def on_this_node(root: Root) -> bool:
    """Whether this process runs in the network namespace of the node whose paths are under ``root``."""
    from cni.cluster import uninstall

    record = uninstall.read_record(root(uninstall.LOCK))
    if record is not None:
        return record.netns == uninstall.this_netns()
    return root.path == Path("/")


def remove_cluster_network(
    root: Root,
    say: Callable[[str], None],
    timeout: float | None = None,
    protocol: int = DEFAULT_PROTOCOL,
    subnets_file: str = DEFAULT_SUBNETS,
) -> None:
    """Ask the agent of ``root`` to remove the cluster network and leave it alone, wait, then remove what is left:
    routes of ``protocol`` and ``subnets_file`` (under ``root``), both from the agent config, never from the lock
    record the last agent left (a record naming others is reported and not obeyed)."""
    from cni.cluster import uninstall

    timeout = AGENT_TIMEOUT if timeout is None else timeout
    if not uninstall.ours(protocol):
        raise NetworkError(f"route protocol {protocol} is one the kernel or a routing daemon uses: never nodeplug's")

    lock_path, marker = root(uninstall.LOCK), root(uninstall.MARKER)
    if root.path != Path("/") and not lock_path.exists():
        return  # no agent has managed a cluster network under this root
    here = on_this_node(root)
    uninstall.request(marker)
    lock = uninstall.Lock(lock_path)
    agent = not lock.try_acquire()
    if agent:
        say(f"asked the running agent to remove the cluster network ({marker}); waiting up to {timeout:.0f} s")
        if not lock.acquire(timeout):
            raise NetworkError(
                f"{lock_path}: the agent holding it did not remove the cluster network within {timeout:.0f} s (its "
                f"log says why); the request stays in {marker}: run the uninstall again to finish"
            )
    try:
        record = lock.read() or uninstall.read_record(lock_path)
        if not here:
            say("left the cluster network alone here: the agent of this root ran in another network namespace; run "
                "the uninstall there")  # fmt: skip
            return
        subnets = root(subnets_file)
        if record is not None and (record.route_protocol, record.subnets_file) != (protocol, str(subnets)):
            say(f"the lock record names route protocol {record.route_protocol} and {record.subnets_file}, not the "
                f"agent config's {protocol} and {subnets}: not obeyed (the config's are removed)")  # fmt: skip
        done = _teardown(protocol, subnets)
        for line in [*done.removed, *done.kept]:
            say(line)
        if agent and not done.removed:
            say("the agent removed the cluster network from this node (its log lists what)")
        if done.failed:
            raise NetworkError("cluster network: " + "; ".join(done.failed) + "; run the uninstall again to retry")
        lock.remove()
    finally:
        lock.release()


def _teardown(protocol: int, subnets: Path) -> Any:
    from cni.cluster import teardown
    from cni.dataplane.rtnl import Rtnl

    nl = Rtnl()
    try:
        return teardown.remove(nl, protocol, subnets)
    finally:
        nl.close()


def withdraw_uninstall(root: Root, say: Callable[[str], None]) -> None:
    """An install: the cluster network is wanted again (the agent takes it up within a second)."""
    from cni.cluster import uninstall

    if uninstall.clear(root(uninstall.MARKER)):
        say(f"withdrew the uninstall request {root(uninstall.MARKER)}: the agent manages the cluster network again")
