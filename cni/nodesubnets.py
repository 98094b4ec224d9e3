"""This node's pod subnets, as the agent last saw them on its Node object: the contract between the cluster network
(:mod:`cni.cluster`, which writes the file) and the CNI IPAM (which reads it).

::

    {"format": 1, "node": "node-a", "podCIDRs": ["10.244.1.0/24", "fd44:0:0:1::/64"], "mtu": 1450,
     "refused": [["10.0.0.0/8", "why"]]}

The agent writes it (atomically) whenever the Node's ``spec.podCIDRs`` or the pod MTU change; a network config
names it in ``ipam.nodeSubnets`` and the IPAM then leases from one range set per podCIDR, whether the agent serves
the call or the entry point works standalone. The file outlives the agent, so pods keep getting addresses of their
own node's subnet while the agent or the API server is away. No file, or one without podCIDRs, means no subnet:
ADD then fails with a CNI error naming the cure, never with a guessed subnet. ``refused`` lists the Node's podCIDRs
the agent would not use as a pod network (one holding the API server's address, say), with the reason, which that
error repeats; a reader that predates it ignores it.

Standard library only (``json``, ``os``) and one small read: it is on the entry point's start-up path.
"""

from __future__ import annotations

import json
import os

DEFAULT_PATH = "/var/lib/nodeplug/cluster/subnets.json"
FORMAT = 1
MAX_BYTES = 64 << 10


class NodeSubnets:
    """What the file says; ``pod_cidrs`` as text in the Node's order (at most one per address family)."""

    __slots__ = ("mtu", "node", "pod_cidrs", "refused")

    def __init__(
        self, node: str, pod_cidrs: tuple[str, ...], mtu: int | None = None, refused: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.node = node
        self.pod_cidrs = pod_cidrs
        self.mtu = mtu
        self.refused = refused

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeSubnets) and self.dumps() == other.dumps()

    def __hash__(self) -> int:
        return hash(self.dumps())

    def __repr__(self) -> str:
        return (
            f"NodeSubnets(node={self.node!r}, pod_cidrs={self.pod_cidrs!r}, mtu={self.mtu!r}, refused={self.refused!r})"
        )

    def dumps(self) -> bytes:
        doc: dict[str, object] = {
            "format": FORMAT,
            "node": self.node,
            "podCIDRs": list(self.pod_cidrs),
            "mtu": self.mtu,
        }
        if self.refused:
            doc["refused"] = [list(r) for r in self.refused]
        return (json.dumps(doc, sort_keys=True) + "\n").encode()


class SubnetsError(ValueError):
    """The file exists but cannot be used; the message names it and the problem."""


def read(path: str) -> NodeSubnets | None:
    """The file's content; None when there is no file. Only the shape is checked here: the CIDRs are parsed (and
    judged) by the IPAM config parser like any range."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SubnetsError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise SubnetsError(f"{path}: larger than {MAX_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise SubnetsError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SubnetsError(f"{path}: expected an object with format {FORMAT}")
    node, cidrs, mtu = doc.get("node"), doc.get("podCIDRs"), doc.get("mtu")
    if not isinstance(node, str):
        raise SubnetsError(f"{path}: node: expected a string")
    if not isinstance(cidrs, list) or len(cidrs) > 2 or not all(isinstance(c, str) for c in cidrs):
        raise SubnetsError(f"{path}: podCIDRs: expected a list of at most two CIDR strings")
    if mtu is not None and (isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= 65535):
        raise SubnetsError(f"{path}: mtu: expected an integer from 68 to 65535 or null")
    refused = doc.get("refused", [])
    if (
        not isinstance(refused, list)
        or len(refused) > 2
        or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) and len(x) <= 1024 for x in r)
            for r in refused
        )
    ):
        raise SubnetsError(f"{path}: refused: expected a list of at most two [CIDR, reason] pairs")
    return NodeSubnets(node, tuple(cidrs), mtu, tuple((str(c), str(why)) for c, why in refused))
