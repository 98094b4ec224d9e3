"""One Kubernetes API client per agent, shared by everything in it that follows the API.

:class:`KubeClient` holds two things built from one :class:`~nodeplug.kube.config.KubeSource`:

- :attr:`KubeClient.api`: a lightkube ``AsyncClient`` for typed (and generic) object work: ``get``, ``create``,
  ``patch``, ``delete``, ``list`` with lightkube's resource classes, e.g. ``lightkube.resources.core_v1.Node`` or
  ``lightkube.resources.resource_v1beta1.ResourceSlice``, and ``lightkube.generic_resource`` for kinds the models
  do not carry. Its errors are ``lightkube.ApiError`` (``e.status.code``);
- raw JSON requests (:meth:`KubeClient.get_json`, :meth:`KubeClient.stream_lines`) for
  :class:`~nodeplug.kube.watch.ListWatch`, which needs what lightkube's watch does not offer (bookmarks, the list's
  resourceVersion together with its items, a relist that notices deletions) and wants objects as plain dicts for the
  pure cores that parse them.

Every request has a timeout. Raw-request failures are :class:`KubeApiError` (the API answered with an error status;
``code``, ``reason`` and the API's message) or :class:`KubeUnavailable` (no answer: connection refused, reset, timed
out, TLS failure).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.config.client_adapter import AsyncClient as adapter_client
from lightkube.config.client_adapter import ConnectionParams
from lightkube.core.resource import NamespacedResource, NamespacedSubResource, Resource, api_info

from nodeplug.kube.config import KubeSource

REQUEST_TIMEOUT = 10.0
FIELD_MANAGER = "nodeplug"


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
