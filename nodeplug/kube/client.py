"""One Kubernetes API client per agent, shared by everything in it that follows the API.

:class:`KubeClient` holds two things built from one :class:`~nodeplug.kube.config.KubeSource`:

- typed object work through lightkube: :meth:`KubeClient.get`, :meth:`~KubeClient.list`, :meth:`~KubeClient.create`,
  :meth:`~KubeClient.replace`, :meth:`~KubeClient.patch`, :meth:`~KubeClient.delete` take and return
  lightkube's resource models (``lightkube.resources.core_v1.Node``,
  ``lightkube.resources.resource_v1beta1.ResourceSlice``, ...), which lightkube decodes and checks against the
  API's schema (msgspec): an object of the wrong shape never reaches the agent. :meth:`KubeClient.read` decodes any
  other path into a model (API discovery). ``api`` is lightkube's ``AsyncClient`` itself;
- raw requests (:meth:`KubeClient.get_json`, :meth:`KubeClient.stream_lines`) for
  :class:`~nodeplug.kube.watch.ListWatch`, which needs what lightkube's list and watch do not offer (bookmarks,
  the list's resourceVersion together with its items, a relist that notices deletions, one malformed object
  skipped rather than the whole list refused) and decodes each object into its model itself. They go through an
  HTTP client of their own made by ``lightkube.config.client_adapter`` from the same configuration: lightkube has
  no public way to hand out the authenticated client it builds (TLS, tokens, exec credentials), and doing that
  again here would be a second copy of its kubeconfig handling.

Every request has a timeout. Errors are one tree, mapped in one place (:func:`api_errors`)::

    KubeError
    ├── KubeUnavailable   no usable answer: connection refused or reset, timed out, TLS failure, an answer that is
    │                     not the object asked for (not JSON, not of the kind's schema)
    └── KubeApiError      the API server answered with an error status (``code``, ``reason``, its message)
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, TypeVar, cast

import httpx2
import msgspec
from lightkube import ApiError, AsyncClient
from lightkube.config.client_adapter import AsyncClient as adapter_client
from lightkube.config.client_adapter import ConnectionParams
from lightkube.core.resource import NamespacedResource, NamespacedSubResource, Resource, api_info
from lightkube.types import PatchType

from nodeplug.kube.config import KubeSource

REQUEST_TIMEOUT = 10.0
FIELD_MANAGER = "nodeplug"

R = TypeVar("R", bound=Resource)
M = TypeVar("M")


class KubeError(Exception):
    """A request to the Kubernetes API failed."""


class KubeUnavailable(KubeError):
    """No answer from the API server (connection refused or reset, timeout, TLS failure)."""


class KubeApiError(KubeError):
    """The API server answered with an error status."""

    def __init__(self, code: int, reason: str, message: str, retry_after: float | None = None) -> None:
        self.code = code
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        super().__init__(f"{code} {reason}: {message}" if message else f"{code} {reason}")


def resource_path(res: type[Resource], name: str | None = None, namespace: str | None = None) -> str:
    """The URL path of a lightkube resource class (collection, or one object with ``name``)."""
    info = api_info(res)
    group, version = info.resource.group, info.resource.version
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    namespaced = issubclass(res, (NamespacedResource, NamespacedSubResource))
    if namespaced and namespace:
        base += f"/namespaces/{namespace}"
    path = f"{base}/{info.plural}"
    return f"{path}/{name}" if name else path


@contextlib.contextmanager
def api_errors(what: str) -> Iterator[None]:
    """The one mapping of what a request can raise (lightkube's ``ApiError``, httpx's transport errors, an answer
    of the wrong shape) to the agent's tree; ``what`` names the request in :class:`KubeUnavailable`."""
    try:
        yield
    except ApiError as e:  # an HTTPError too: first
        st = e.status
        raise KubeApiError(st.code or e.response.status_code, st.reason or "", st.message or "") from None
    except httpx2.HTTPError as e:
        raise KubeUnavailable(f"{what}: {type(e).__name__}: {e}") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise KubeUnavailable(f"{what}: the answer is not of the kind's schema: {e}") from None


def decode(obj: object, model: type[M]) -> M:
    """``obj`` (JSON as decoded) as ``model``, checked against its schema; msgspec.ValidationError if it is not."""
    return msgspec.convert(obj, model)


def _status_error(resp: httpx2.Response, body: bytes) -> KubeApiError:
    reason, message = resp.reason_phrase or "", ""
    try:
        status = json.loads(body)
        if isinstance(status, dict):
            reason = str(status.get("reason") or reason)
            message = str(status.get("message") or "")
    except ValueError:
        message = body[:300].decode(errors="replace")
    retry = resp.headers.get("Retry-After")
    retry_after = float(retry) if retry and retry.isdigit() else None
    return KubeApiError(resp.status_code, reason, message, retry_after)


class KubeClient:
    """The agent's connection to the API server (see the module docstring). Close it with :meth:`close`."""

    def __init__(
        self,
        source: KubeSource,
        field_manager: str = FIELD_MANAGER,
        timeout: float = REQUEST_TIMEOUT,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        self.source = source
        self.timeout = timeout
        self.api = AsyncClient(
            source.config, field_manager=field_manager, timeout=httpx2.Timeout(timeout), transport=transport
        )
        # Raw requests: its own connection pool, so a long watch never waits behind (or holds up) typed calls.
        params = ConnectionParams(timeout=httpx2.Timeout(timeout), transport=transport)  # type: ignore[arg-type]
        self._http = adapter_client(source.config, params)
        # when the API server last answered a raw request (time.monotonic()), None before it ever did
        self.last_answer: float | None = None

    async def close(self) -> None:
        await self._http.aclose()
        await self.api.close()

    # ------------------------------------------------------------ typed objects

    # lightkube types each call per scope (global or namespaced, object or subresource); these are generic over any
    # resource, so they call it through ``_api`` (Any) and return what it gave, which is of the class asked for.

    @property
    def _api(self) -> Any:
        return self.api

    async def get(self, res: type[R], name: str, namespace: str | None = None) -> R:
        with api_errors(f"get {res.__name__} {name}"):
            return cast(R, await self._api.get(res, name, namespace=namespace))

    async def list(
        self, res: type[R], *, namespace: str | None = None, fields: Mapping[str, str] | None = None
    ) -> list[R]:
        """Every object of ``res`` (matching the field selector ``fields``), all pages."""
        with api_errors(f"list {res.__name__}"):
            return [cast(R, o) async for o in self._api.list(res, namespace=namespace, fields=dict(fields or {}))]

    async def create(self, obj: R) -> R:
        """The object as the API server stored it."""
        with api_errors(f"create {type(obj).__name__}"):
            return cast(R, await self._api.create(obj))

    async def replace(self, obj: R) -> R:
        """The object as the API server stored it (a conflict when its resourceVersion is not the stored one)."""
        with api_errors(f"replace {type(obj).__name__}"):
            return cast(R, await self._api.replace(obj))

    async def patch(
        self,
        res: type[R],
        name: str,
        patch: Mapping[str, object],
        namespace: str | None = None,
        patch_type: PatchType = PatchType.MERGE,
    ) -> R:
        """A patch of one object (or subresource: ``Node.Status``), a JSON merge patch (RFC 7386) unless
        ``patch_type`` says otherwise; the object as stored."""
        with api_errors(f"patch {res.__name__} {name}"):
            stored = await self._api.patch(res, name, dict(patch), namespace=namespace, patch_type=patch_type)
            return cast(R, stored)

    async def delete(self, res: type[R], name: str, namespace: str | None = None) -> None:
        """Delete one object; one that is gone already is what was asked (no error)."""
        try:
            with api_errors(f"delete {res.__name__} {name}"):
                await self._api.delete(res, name, namespace=namespace)
        except KubeApiError as e:
            if e.code != 404:
                raise

    async def read(self, path: str, model: type[M]) -> M:
        """GET ``path`` and decode the answer as ``model`` (e.g. ``lightkube.models.meta_v1.APIGroup``)."""
        data = await self.get_json(path)
        with api_errors(f"GET {path}"):
            return decode(data, model)

    # ------------------------------------------------------------ raw requests (ListWatch)

    async def get_json(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        """GET ``path`` and return the decoded JSON object."""
        try:
            resp = await self._http.get(path, params=dict(params or {}))
        except httpx2.HTTPError as e:
            raise KubeUnavailable(f"GET {path}: {type(e).__name__}: {e}") from None
        self.last_answer = time.monotonic()
        if resp.status_code >= 400:
            raise _status_error(resp, resp.content)
        try:
            data = json.loads(resp.content)
        except ValueError as e:
            raise KubeUnavailable(f"GET {path}: the answer is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise KubeUnavailable(f"GET {path}: expected a JSON object, got {type(data).__name__}")
        return data

    async def stream_lines(
        self, path: str, params: Mapping[str, str], read_timeout: float
    ) -> AsyncIterator[dict[str, Any]]:
        """GET ``path`` as a stream of JSON lines (a watch); each line decoded. Ends when the server ends it; raises
        :class:`KubeUnavailable` when nothing arrives for ``read_timeout`` seconds or the connection breaks."""
        timeout = httpx2.Timeout(self.timeout, read=read_timeout)
        try:
            async with self._http.stream("GET", path, params=dict(params), timeout=timeout) as resp:
                if resp.status_code >= 400:
                    raise _status_error(resp, await resp.aread())
                async for line in resp.aiter_lines():
                    self.last_answer = time.monotonic()
                    if not line.strip():
                        continue
                    try:
                        event = json.loads(line)
                    except ValueError as e:
                        raise KubeUnavailable(f"watch {path}: a line that is not JSON: {e}") from None
                    if isinstance(event, dict):
                        yield event
        except httpx2.HTTPError as e:
            raise KubeUnavailable(f"watch {path}: {type(e).__name__}: {e}") from None
