"""This node's own Node object, as the cluster network writes to it: the VTEP annotations peers program their FDB
and neighbours from, and the NetworkUnavailable condition, cleared once the pod network is programmed.

Both are written only when they differ from what the watch last showed, retried with the watch's backoff when the
API server refuses (the caller's next pass is asked for by ``again``), and never block a pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from cni.cluster.model import NETWORK_UNAVAILABLE, VTEP_ADDRESS, VTEP_MAC, Vtep, network_unavailable
from nodeplug.kube import Backoff, KubeClient, KubeError
from nodeplug.log import Logger

CONDITION_REASON = "NodeplugRoutesProgrammed"


class OwnNode:
    def __init__(self, kube: KubeClient, name: str, log: Logger, backoff: Backoff, again: Callable[[], None]) -> None:
        self.kube, self.name, self.log, self.backoff, self.again = kube, name, log, backoff, again
        self.seen = False  # the watch has shown this Node
        self.annotations: Mapping[str, Any] = {}
        self.condition: tuple[str, str] | None = None  # its NetworkUnavailable (status, reason)
        self._published: tuple[str, str] | None = None
        self._publish_failures = 0
        self._condition_failures = 0

    def update(self, obj: Node) -> bool:
        """The watch's latest of this Node; True when its NetworkUnavailable was set to something else than ours (a
        cloud node controller does at registration): a full pass should set it again."""
        self.seen = True
        notes = obj.metadata.annotations if obj.metadata is not None else None
        self.annotations = notes if isinstance(notes, dict) else {}
        condition = network_unavailable(obj)
        changed = condition != self.condition and condition != ("False", CONDITION_REASON)
        self.condition = condition
        return changed

    def forget(self) -> None:
        """This Node was deleted."""
        self.seen = False
        self.annotations = {}

    async def network_available(self) -> bool:
        """Set this Node's NetworkUnavailable condition to False once its pod network is programmed, as pod networks
        do (cloud node controllers set it True at registration, and the scheduler keeps pods off such a node). Never
        set back to True: not on a failed pass, and not when the API server errs; it is the node's network that
        counts. False when the API server refused it (the caller asks for a full pass again)."""
        if not self.seen or self.condition == ("False", CONDITION_REASON):
            return True
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {"type": NETWORK_UNAVAILABLE, "status": "False", "reason": CONDITION_REASON,
                     "message": "nodeplug routes this node's pod subnets to every peer", "lastTransitionTime": now,
                     "lastHeartbeatTime": now}  # fmt: skip
        try:
            patch = {"status": {"conditions": [condition]}}
            await self.kube.patch(Node.Status, self.name, patch, patch_type=PatchType.STRATEGIC)
        except KubeError as e:  # retried with backoff (and after every full pass)
            self._condition_failures += 1
            delay = self.backoff.delay(self._condition_failures)
            self.log.warning(
                "cannot set this Node's NetworkUnavailable condition", error=str(e) or repr(e), retry=delay
            )
            asyncio.get_running_loop().call_later(delay, self.again)
            return False
        self._condition_failures = 0
        self.condition = ("False", CONDITION_REASON)
        self.log.info("set this Node's NetworkUnavailable condition to False", reason=CONDITION_REASON)
        return True

    async def publish(self, vtep: Vtep | None) -> None:
        """This node's VXLAN endpoint as annotations on its Node (a merge patch of exactly those two keys)."""
        if vtep is None or not self.seen:
            return
        want = (vtep.mac, str(vtep.address))
        have = (self.annotations.get(VTEP_MAC), self.annotations.get(VTEP_ADDRESS))
        if have == want or self._published == want:
            return
        patch = {"metadata": {"annotations": {VTEP_MAC: want[0], VTEP_ADDRESS: want[1]}}}
        try:
            await self.kube.patch(Node, self.name, patch)
        except KubeError as e:  # retried with backoff (and on every pass)
            self._publish_failures += 1
            delay = self.backoff.delay(self._publish_failures)
            self.log.warning("cannot publish this node's VTEP on its Node", error=str(e) or repr(e), retry=delay)
            asyncio.get_running_loop().call_later(delay, self.again)
            return
        self._publish_failures = 0
        self._published = want
        self.log.info("published this node's VTEP", mac=want[0], address=want[1])
