"""The size a claim's PersistentVolume gives its volume, read at NodeStageVolume.

Expansion is node-only: external-resizer records a claim's new size in its PersistentVolume, and kubelet asks the
node to grow the volume (NodeExpandVolume) only after it has staged *and published* it for the next pod (kubelet
1.32 expands while mounting, after SetUp), when the volume is mounted twice and an ext4 can only grow online, which
needs CAP_SYS_RESOURCE. So NodeStageVolume looks first: when the PV, read from the API server, is this driver's
volume and says more than the volume has, the backing file grows then, and the filesystem is grown before it is
mounted (offline for ext4: :mod:`csi.offlinegrow`); kubelet's NodeExpandVolume then finds it grown. This is a
shortcut, never a dependency: without an API server, or when the read fails or takes longer than
:data:`TIMEOUT`, stage goes on as before and NodeExpandVolume grows the volume as it always did.

The PV's name is the volume's name (external-provisioner creates the volume under the PV's name); its
``spec.csi.driver`` and ``volumeHandle`` must name this driver and this volume, or its size is not taken.
"""

from __future__ import annotations

import asyncio
import decimal
import math

from lightkube.resources.core_v1 import PersistentVolume
from lightkube.utils.quantity import parse_quantity

from nodeplug.kube import KubeClient, KubeError
from nodeplug.log import Logger

TIMEOUT = 5.0
MAX_BYTES = 1 << 60  # a PV larger than this is not a size to act on


def capacity_of(pv: PersistentVolume, driver: str, volume_id: str) -> int | None:
    """The bytes ``spec.capacity.storage`` of ``pv`` says, when ``pv`` is ``driver``'s volume ``volume_id``; None
    for anything else, or for a quantity that is not a positive size."""
    spec = pv.spec
    if spec is None or spec.csi is None or spec.csi.driver != driver or spec.csi.volumeHandle != volume_id:
        return None
    quantity = (spec.capacity or {}).get("storage")
    if not isinstance(quantity, str):
        return None
    try:
        value = parse_quantity(quantity)
    except (ValueError, TypeError, ArithmeticError, decimal.InvalidOperation):
        return None
    if value is None or not value.is_finite() or value <= 0 or value > MAX_BYTES:
        return None
    return math.ceil(value)


class PvSizes:
    def __init__(self, client: KubeClient, driver: str, log: Logger) -> None:
        self.client = client
        self.driver = driver
        self.log = log

    async def size(self, name: str, volume_id: str) -> int | None:
        """The size the PV ``name`` gives ``volume_id`` (None when it cannot be had now, or does not say)."""
        try:
            pv = await asyncio.wait_for(self.client.get(PersistentVolume, name), TIMEOUT)
        except (KubeError, TimeoutError) as e:
            self.log.debug("PersistentVolume not read at stage", volume_id=volume_id, pv=name, error=str(e))
            return None
        return capacity_of(pv, self.driver, volume_id)
