"""The DRA driver's requests to the API server, through the agent's :class:`nodeplug.kube.KubeClient`.

- :func:`served_version`: which ``resource.k8s.io`` version to speak (``v1`` where served, Kubernetes 1.34+; else
  ``v1beta1``, 1.32 and 1.33), from API discovery;
- :class:`ClaimReader`: one ResourceClaim by namespace and name (the :class:`~deviceplugin.dra.prepare.ClaimSource`
  of the preparer), failures turned into :class:`~deviceplugin.dra.claims.ClaimError` naming the claim;
- :func:`node_uid`: the Node's UID, for the slices' owner reference (so they go when the Node goes);
- :class:`SliceWriter`: create, replace and delete this driver's ResourceSlices with lightkube's typed models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import httpx2
from lightkube import ApiError
from lightkube.resources import resource_v1, resource_v1beta1

from deviceplugin.dra.claims import ClaimError
from nodeplug.kube import KubeApiError, KubeClient, KubeError, KubeUnavailable

GROUP = "resource.k8s.io"
VERSIONS = ("v1", "v1beta1")


class VersionUnavailable(KubeError):
    """The API server serves none of the resource.k8s.io versions this driver speaks."""


async def served_version(client: KubeClient, wanted: str = "auto") -> str:
    try:
        doc = await client.get_json(f"/apis/{GROUP}")
    except KubeApiError as e:
        if e.code == 404:
            raise VersionUnavailable(
                f"the API server does not serve {GROUP}: enable DynamicResourceAllocation"
            ) from None
        raise
    served = {v.get("version") for v in doc.get("versions") or () if isinstance(v, Mapping)}
    for v in VERSIONS if wanted == "auto" else (wanted,):
        if v in served:
            return v
    raise VersionUnavailable(
        f"the API server serves {GROUP} versions {sorted(str(s) for s in served)}, none of "
        f"{list(VERSIONS) if wanted == 'auto' else [wanted]} (on 1.32 and 1.33: --runtime-config={GROUP}/v1beta1=true)"
    )


async def node_uid(client: KubeClient, node: str) -> str:
    """The Node's UID; "" when there is no such Node (yet)."""
    try:
        obj = await client.get_json(f"/api/v1/nodes/{node}")
    except KubeApiError as e:
        if e.code == 404:
            return ""
        raise
    meta = obj.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) else ""


class ClaimReader:
    def __init__(self, client: KubeClient, version: str) -> None:
        self.client = client
        self.version = version

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        path = f"/apis/{GROUP}/{self.version}/namespaces/{namespace}/resourceclaims/{name}"
        try:
            return await self.client.get_json(path)
        except KubeApiError as e:
            if e.code == 404:
                raise ClaimError(f"ResourceClaim {namespace}/{name} not found") from None
            raise ClaimError(f"ResourceClaim {namespace}/{name}: the API server answered {e}") from None
        except KubeUnavailable as e:
            raise ClaimError(
                f"ResourceClaim {namespace}/{name} cannot be read now (kubelet will ask again): {e}"
            ) from None


def _resource(version: str) -> type[Any]:
    return resource_v1.ResourceSlice if version == "v1" else resource_v1beta1.ResourceSlice


@contextlib.contextmanager
def _kube_errors(what: str) -> Iterator[None]:
    """lightkube's failures as the agent's error tree: an error status is :class:`KubeApiError`, a transport failure
    :class:`KubeUnavailable` naming ``what``."""
    try:
        yield
    except ApiError as e:
        raise KubeApiError(e.status.code or 0, e.status.reason or "", e.status.message or "") from None
    except httpx2.HTTPError as e:
        raise KubeUnavailable(f"{what}: {type(e).__name__}: {e}") from None


class SliceWriter:
    """Writes ResourceSlices; every method returns the object as the API server stored it (a dict) or raises
    :class:`KubeError` (conflict included: the caller reconciles again from what the watch shows)."""

    def __init__(self, client: KubeClient, version: str) -> None:
        self.client = client
        self.version = version
        self.resource = _resource(version)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        with _kube_errors("create ResourceSlice"):
            made = await self.client.api.create(self.resource.from_dict(obj))
        out: dict[str, Any] = made.to_dict()
        return out

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        with _kube_errors("replace ResourceSlice"):
            made = await self.client.api.replace(self.resource.from_dict(obj))
        out: dict[str, Any] = made.to_dict()
        return out

    async def delete(self, name: str) -> None:
        try:
            with _kube_errors(f"delete ResourceSlice {name}"):
                await self.client.api.delete(self.resource, name)
        except KubeApiError as e:
            if e.code != 404:  # gone already is what was asked
                raise
