"""The DRA driver's requests to the API server, through the agent's :class:`nodeplug.kube.KubeClient`, with
lightkube's typed models of ``resource.k8s.io`` (v1beta1 for Kubernetes 1.32 and 1.33, v1 from 1.34):

- :func:`served_version`: which ``resource.k8s.io`` version to speak (``v1`` where served, else ``v1beta1``), from
  API discovery;
- :func:`kinds`: the ResourceClaim and ResourceSlice classes of a version;
- :class:`ClaimReader`: one ResourceClaim by namespace and name (the :class:`~deviceplugin.dra.prepare.ClaimSource`
  of the preparer), failures turned into :class:`~deviceplugin.dra.claims.ClaimError` naming the claim;
- :func:`node_uid`: the Node's UID, for the slices' owner reference (so they go when the Node goes).
"""

from __future__ import annotations

from typing import NamedTuple

from lightkube.models.meta_v1 import APIGroup
from lightkube.resources import resource_v1, resource_v1beta1
from lightkube.resources.core_v1 import Node

from deviceplugin.dra.claims import Claim, ClaimError
from deviceplugin.dra.slices import Slice
from nodeplug.kube import KubeApiError, KubeClient, KubeError, KubeUnavailable

GROUP = "resource.k8s.io"
VERSIONS = ("v1", "v1beta1")


class VersionUnavailable(KubeError):
    """The API server serves none of the resource.k8s.io versions this driver speaks."""


class Kinds(NamedTuple):
    claim: type[Claim]
    slice: type[Slice]


def kinds(version: str) -> Kinds:
    if version == "v1":
        return Kinds(resource_v1.ResourceClaim, resource_v1.ResourceSlice)
    return Kinds(resource_v1beta1.ResourceClaim, resource_v1beta1.ResourceSlice)


async def served_version(client: KubeClient, wanted: str = "auto") -> str:
    try:
        group = await client.read(f"/apis/{GROUP}", APIGroup)
    except KubeApiError as e:
        if e.code == 404:
            raise VersionUnavailable(
                f"the API server does not serve {GROUP}: enable DynamicResourceAllocation"
            ) from None
        raise
    served = {v.version for v in group.versions}
    for v in VERSIONS if wanted == "auto" else (wanted,):
        if v in served:
            return v
    raise VersionUnavailable(
        f"the API server serves {GROUP} versions {sorted(served)}, none of "
        f"{list(VERSIONS) if wanted == 'auto' else [wanted]} (on 1.32 and 1.33: --runtime-config={GROUP}/v1beta1=true)"
    )


async def node_uid(client: KubeClient, node: str) -> str:
    """The Node's UID; "" when there is no such Node (yet)."""
    try:
        obj = await client.get(Node, node)
    except KubeApiError as e:
        if e.code == 404:
            return ""
        raise
    return (obj.metadata.uid if obj.metadata is not None else None) or ""


class ClaimReader:
    def __init__(self, client: KubeClient, version: str) -> None:
        self.client = client
        self.version = version
        self.kind = kinds(version).claim

    async def get_claim(self, namespace: str, name: str) -> Claim:
        try:
            return await self.client.get(self.kind, name, namespace=namespace)
        except KubeApiError as e:
            if e.code == 404:
                raise ClaimError(f"ResourceClaim {namespace}/{name} not found") from None
            raise ClaimError(f"ResourceClaim {namespace}/{name}: the API server answered {e}") from None
        except KubeUnavailable as e:
            raise ClaimError(
                f"ResourceClaim {namespace}/{name} cannot be read now (kubelet will ask again): {e}"
            ) from None
