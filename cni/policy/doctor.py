"""``nodeplug doctor``: network policy on this node, checked independently of the agent's account.

The NetworkPolicies, Namespaces and Pods are listed from the API server here, compiled as the agent would
(:mod:`cni.policy.compile`), and compared with the kernel's table; the check fails naming what differs. Its output
lists, for every pod of this node that a policy selects, the policies selecting it and what they allow.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from cni.dataplane.tools import ToolError, run_tool
from cni.policy.compile import DIRECTIONS, Compiler
from cni.policy.config import PolicyConfig
from cni.policy.model import Policy, Rule, parse_namespace, parse_pod, parse_policy
from cni.policy.ruleset import TABLE
from nodeplug.checks import Check, CheckFailed, CheckSkipped
from nodeplug.kube import KubeError
from nodeplug.plugin import AgentContext


def describe_rule(c: Compiler, policy: Policy, rule: Rule) -> str:
    if rule.peers is None:
        peers = "anyone"
    else:
        shown = []
        for p in rule.peers:
            shown.append(p.text)
        peers = " or ".join(shown)
        pods = c.peers_of(policy, rule)
        if any(not p.is_block for p in rule.peers):
            peers += f" ({len(pods)} pod(s) now)"
    ports = ", ".join(str(p) for p in rule.ports) or "any port"
    return f"{peers} on {ports}"


def explain(c: Compiler, pods: Iterable[str] = ()) -> list[str]:
    """One line per direction for each pod of this node a policy selects (or those named)."""
    lines = []
    wanted = set(pods)
    for pod in sorted(c.local_pods(), key=lambda p: p.key):
        if wanted and pod.key not in wanted:
            continue
        for d in DIRECTIONS:
            pols = c.selecting(pod, d)
            if not pols:
                continue
            allows = [f"{p.name}: " + ("; ".join(describe_rule(c, p, r) for r in p.rules(d) or ()) or "nothing")
                      for p in pols]  # fmt: skip
            lines.append(f"{pod.key} {d} isolated by {len(pols)} polic(ies), allows {' | '.join(allows)}")
    return lines


def kernel_view() -> dict[str, set[str]]:
    """The table's chains and sets, and the keys of its verdict maps ("in4:10.244.1.5")."""
    try:
        text = run_tool(["nft", "-j", "list", "table", "inet", TABLE], timeout=30)
    except ToolError as e:
        if "No such file or directory" in e.stderr:
            return {}
        raise CheckFailed(f"nft: {e}") from None
    out: dict[str, set[str]] = {"chains": set(), "sets": set(), "map": set()}
    for item in json.loads(text).get("nftables", []):
        if "chain" in item:
            out["chains"].add(item["chain"]["name"])
        elif "set" in item:
            out["sets"].add(item["set"]["name"])
        elif "map" in item:
            m = item["map"]
            for elem in m.get("elem") or []:
                key = elem[0] if isinstance(elem, list) else None
                if isinstance(key, str):
                    out["map"].add(f"{m['name']}:{key}")
    return out


def checks(section: PolicyConfig, ctx: AgentContext) -> list[Check]:
    async def compare() -> str:
        from lightkube.resources.core_v1 import Namespace, Pod
        from lightkube.resources.networking_v1 import NetworkPolicy

        if ctx.kube is None:
            raise CheckSkipped("no Kubernetes API configured: single-node")
        c = Compiler(ctx.node_name)
        try:
            for ns in await ctx.kube.list(Namespace):
                if (info := parse_namespace(ns)) is not None:
                    c.set_namespace(info.name, info)
            for obj in await ctx.kube.list(Pod):
                if (pod := parse_pod(obj)) is not None:
                    c.set_pod(pod.key, pod)
            for np in await ctx.kube.list(NetworkPolicy):
                if (pol := parse_policy(np)) is not None:
                    c.set_policy(pol.key, pol)
        except KubeError as e:
            raise CheckSkipped(f"cannot list from the API server: {e}") from None
        want = c.ruleset()
        have = kernel_view()
        if not have:
            raise CheckFailed(f"table inet {TABLE} is not there: is the agent running with network_policy enabled?")
        problems = [f"chain {n} missing" for n in sorted(set(want.chains) - have["chains"])]
        problems += [f"set {n} missing" for n in sorted(set(want.sets) - have["sets"] - {k for k in want.maps})]
        want_keys = {f"{m}:{k}" for m, entries in want.maps.items() for k in entries}
        problems += [f"{k.split(':', 1)[1]} not isolated ({k.split(':')[0]})" for k in sorted(want_keys - have["map"])]
        problems += [f"{k.split(':', 1)[1]} isolated, no policy says so" for k in sorted(have["map"] - want_keys)]
        lines = explain(c)
        summary = f"{len(c.policies)} policies; {len(c.local_pods())} pods here" + "".join(f"\n  {x}" for x in lines)
        if problems:
            raise CheckFailed("; ".join(problems[:10]) + f" (pods just added or changed are in flux)\n{summary}")
        return summary

    return [Check("network_policy", "rules match the API", compare)]
