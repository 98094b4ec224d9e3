"""The agent's Kubernetes API client: configuration, one shared connection, and a resilient list+watch.

- :mod:`nodeplug.kube.config`: where the API is (``--kubeconfig``, ``KUBECONFIG``, the in-cluster service account,
  or nowhere: single-node mode) and this node's name;
- :mod:`nodeplug.kube.client`: :class:`KubeClient`, typed object requests over lightkube's models (``get``,
  ``list``, ``create``, ``replace``, ``patch``, ``delete``), with one mapping of every failure to the error tree
  ``KubeError`` > ``KubeUnavailable`` | ``KubeApiError`` (:func:`api_errors`);
- :mod:`nodeplug.kube.watch`: :class:`ListWatch`, list + watch with resume, relist on 410, bookmarks and backoff,
  yielding the kind's lightkube model (``ListWatch(client, Node)``, ``ListWatch(client, Pod, namespace=...)``,
  ``Namespace``, ``NetworkPolicy``, ``ResourceSlice``: any kind lightkube models), checked against its schema.

Nothing passed inward is a ``dict`` of the wire: objects are lightkube's models (msgspec structs, typed and checked on
decode); their values are still the API's, to be checked by whoever acts on them. The API server is a source of
truth the agent follows, never a dependency it waits on: nothing here blocks start-up, and a watch outlives any
outage. :mod:`nodeplug.kube.events` records the Events the plugins emit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nodeplug.kube.client import KubeApiError, KubeClient, KubeError, KubeUnavailable, api_errors, resource_path
    from nodeplug.kube.config import KubeConfigError, KubeSource, node_name, resolve
    from nodeplug.kube.watch import Backoff, Event, ListWatch, WatchStatus

# Each name is imported from its module on first use (PEP 562), so that importing nodeplug.kube.config to find out
# whether any API is configured does not load lightkube and httpx (several MiB of a single-node agent's memory).
_HOME = {
    **dict.fromkeys(
        ("KubeApiError", "KubeClient", "KubeError", "KubeUnavailable", "api_errors", "resource_path"), "client"
    ),
    **dict.fromkeys(("KubeConfigError", "KubeSource", "node_name", "resolve"), "config"),
    **dict.fromkeys(("Backoff", "Event", "ListWatch", "WatchStatus"), "watch"),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Backoff",
    "Event",
    "KubeApiError",
    "KubeClient",
    "KubeConfigError",
    "KubeError",
    "KubeSource",
    "KubeUnavailable",
    "ListWatch",
    "WatchStatus",
    "api_errors",
    "node_name",
    "resolve",
    "resource_path",
]
