"""The Kubernetes client's own logic: where the API is, resource paths, and ListWatch's resume/relist/backoff
protocol handling, against a scripted HTTP transport (the real API server is in tests/e2e/test_cluster_network*)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube.resources.core_v1 import ConfigMap, Node
from lightkube.resources.resource_v1beta1 import ResourceSlice

from nodeplug.kube import (
    Backoff,
    Event,
    KubeApiError,
    KubeClient,
    KubeConfigError,
    KubeUnavailable,
    ListWatch,
    node_name,
    resolve,
    resource_path,
)
from nodeplug.kube.watch import diff

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://10.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_resolve_order(tmp_path: Path) -> None:
    kc = tmp_path / "kc"
    kc.write_text(KUBECONFIG)
    assert resolve(None, env={}) is None  # nothing configured: single-node mode
    src = resolve(kc, env={"KUBECONFIG": "/nonexistent"})
    assert src is not None and src.server == "https://10.0.0.1:6443" and "--kubeconfig" in src.origin
    src = resolve(None, env={"KUBECONFIG": f"{kc}:/other"})
    assert src is not None and src.origin == f"KUBECONFIG {kc}"
    # in-cluster needs the env and the token
    sa = tmp_path / "sa"
    sa.mkdir()
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    assert resolve(None, env=env, account_dir=sa) is None
    (sa / "token").write_text("t")
    (sa / "namespace").write_text("nodeplug-system")
    (sa / "ca.crt").write_text("")
    src = resolve(None, env=env, account_dir=sa)
    assert src is not None and src.server == "https://[fd00::1]:443" and "in-cluster" in src.origin


@pytest.mark.parametrize(
    "text, problem",
    [
        (None, "no such file"),
        ("{not yaml: [", "not a usable kubeconfig"),
        ("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n", "kubeconfig"),
    ],
)
def test_named_but_unusable_kubeconfig_is_an_error(tmp_path: Path, text: str | None, problem: str) -> None:
    kc = tmp_path / "kc"
    if text is not None:
        kc.write_text(text)
    with pytest.raises(KubeConfigError, match=problem) as e:
        resolve(kc, env={})
    assert str(kc) in str(e.value)


def test_node_name() -> None:
    assert node_name("Node-A", env={"NODE_NAME": "b"}) == "node-a"
    assert node_name(None, env={"NODE_NAME": "b"}) == "b"
    assert node_name(None, env={})  # the host name


def test_resource_paths() -> None:
    assert resource_path(Node) == "/api/v1/nodes"
    assert resource_path(Node, "n1") == "/api/v1/nodes/n1"
    assert resource_path(ConfigMap, "x", namespace="ns") == "/api/v1/namespaces/ns/configmaps/x"
    assert resource_path(ResourceSlice) == "/apis/resource.k8s.io/v1beta1/resourceslices"


def node(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv}}


def typed(name: str, rv: str) -> Node:
    return Node.from_dict(node(name, rv))


def test_diff_reports_deletions_additions_and_changes() -> None:
    old = {"a": "1", "b": "2", "c": "3", "ns/e": "4"}
    new = {"b": typed("b", "2"), "c": typed("c", "9"), "d": typed("d", "10")}
    versions = {k: o.metadata.resourceVersion or "" for k, o in new.items() if o.metadata is not None}
    events = diff(old, versions, new, {})
    assert [(e.type, e.key) for e in events] == [
        ("DELETED", "a"),
        ("DELETED", "ns/e"),
        ("MODIFIED", "c"),
        ("ADDED", "d"),
    ]
    # a deletion carries the object's last state when it was kept, else nothing (its key names it)
    assert events[1].obj is None
    assert diff(old, versions, new, {"a": typed("a", "1")})[0].obj == typed("a", "1")


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    b = Backoff(base=0.1, cap=2.0)
    lo = [b.delay(n, lambda lo, hi: lo) for n in range(8)]
    hi = [b.delay(n, lambda lo, hi: hi) for n in range(8)]
    assert hi[:5] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6]) and hi[5:] == [2.0, 2.0, 2.0]
    assert all(x == y / 2 for x, y in zip(lo, hi, strict=True))


# ---------------------------------------------------------------- ListWatch against a scripted server


class Script:
    """Answers each request with the next scripted response for its kind (list or watch); records the requests."""

    def __init__(self, lists: list[Any], watches: list[Any]) -> None:
        self.lists, self.watches = lists, watches
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        queue = self.watches if request.url.params.get("watch") == "1" else self.lists
        if not queue:
            return httpx2.Response(503, json={"kind": "Status", "reason": "ServiceUnavailable", "message": "done"})
        answer = queue.pop(0)
        if isinstance(answer, int):
            return httpx2.Response(answer, json={"kind": "Status", "code": answer, "reason": "X", "message": "m"})
        if isinstance(answer, list):  # watch lines
            return httpx2.Response(200, content="".join(json.dumps(x) + "\n" for x in answer).encode())
        return httpx2.Response(200, json=answer)


def nodelist(rv: str, *items: dict[str, Any], cont: str = "") -> dict[str, Any]:
    meta = {"resourceVersion": rv, **({"continue": cont} if cont else {})}
    return {"kind": "NodeList", "metadata": meta, "items": list(items)}


async def collect(script: Script, n: int, check: Callable[[ListWatch[Node]], None] | None = None) -> list[Event[Node]]:
    src = resolve(None, env={"KUBECONFIG": str(_kubeconfig())})
    assert src is not None
    client = KubeClient(src, transport=httpx2.MockTransport(script))
    lw = ListWatch(client, Node, backoff=Backoff(0.001, 0.002), watch_seconds=(5, 5), page_size=2)
    out: list[Event[Node]] = []
    try:
        async with asyncio.timeout(5):
            async for ev in lw.events():
                out.append(ev)
                if len(out) == n:
                    break
        if check:
            check(lw)
    finally:
        await client.close()
    return out


_KC: list[Path] = []


def _kubeconfig() -> Path:
    if not _KC:
        import tempfile

        p = Path(tempfile.mkdtemp()) / "kc"
        p.write_text(KUBECONFIG)
        _KC.append(p)
    return _KC[0]


async def test_listwatch_pages_then_watches_from_the_list_resource_version() -> None:
    script = Script(
        lists=[nodelist("10", node("a", "1"), node("b", "2"), cont="t1"), nodelist("10", node("c", "3"))],
        watches=[[{"type": "ADDED", "object": node("d", "11")}, {"type": "DELETED", "object": node("a", "12")}]],
    )
    events = await collect(script, 6)
    assert [(e.type, e.key) for e in events] == [
        ("ADDED", "a"), ("ADDED", "b"), ("ADDED", "c"), ("SYNCED", ""), ("ADDED", "d"), ("DELETED", "a"),
    ]  # fmt: skip
    watch = next(r for r in script.requests if r.url.params.get("watch") == "1")
    assert watch.url.params["resourceVersion"] == "10" and watch.url.params["allowWatchBookmarks"] == "true"
    assert script.requests[1].url.params["continue"] == "t1"


async def test_listwatch_resumes_after_bookmark_and_relists_on_gone_reporting_deletions() -> None:
    script = Script(
        lists=[nodelist("10", node("a", "1"), node("b", "2")), nodelist("30", node("b", "2"), node("c", "25"))],
        watches=[
            [{"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {"resourceVersion": "20"}}}],
            [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "old"}}],
        ],
    )

    def check(lw: ListWatch[Node]) -> None:
        assert set(lw.cache) == {"b", "c"} and lw.resource_version == "30" and lw.status.relists == 2

    events = await collect(script, 6, check)
    assert [(e.type, e.key) for e in events] == [
        ("ADDED", "a"), ("ADDED", "b"), ("SYNCED", ""), ("DELETED", "a"), ("ADDED", "c"), ("SYNCED", ""),
    ]  # fmt: skip
    watches = [r.url.params["resourceVersion"] for r in script.requests if r.url.params.get("watch") == "1"]
    assert watches[:2] == ["10", "20"]  # the second watch resumed from the bookmark


async def test_listwatch_backs_off_on_errors_and_relists_on_410_status() -> None:
    script = Script(lists=[500, 429, nodelist("5", node("a", "1")), nodelist("8")], watches=[410])
    events = await collect(script, 4)
    assert [(e.type, e.key) for e in events] == [("ADDED", "a"), ("SYNCED", ""), ("DELETED", "a"), ("SYNCED", "")]


async def test_listwatch_yields_typed_objects_and_takes_one_of_another_shape_as_absent() -> None:
    """Objects are the kind's model, checked against its schema at the edge; an object sent in another shape is
    refused alone (the rest of the list goes on) and counts as absent: DELETED, with its last good state."""
    bad_b = {"metadata": {"name": "b", "resourceVersion": "3"}, "spec": {"podCIDRs": "10.244.0.0/24"}}
    good_b = {"metadata": {"name": "b", "resourceVersion": "2"}, "spec": {"podCIDRs": ["10.244.1.0/24"]}}
    script = Script(
        lists=[nodelist("10", node("a", "1"), good_b, {"metadata": {"name": "c", "uid": 7}})],
        watches=[[{"type": "MODIFIED", "object": bad_b}, {"type": "ADDED", "object": node("d", "11")}]],
    )
    events = await collect(script, 5)
    assert [(e.type, e.key) for e in events] == [
        ("ADDED", "a"), ("ADDED", "b"), ("SYNCED", ""), ("DELETED", "b"), ("ADDED", "d"),
    ]  # fmt: skip
    assert all(isinstance(e.obj, Node) for e in events if e.type != "SYNCED")
    deleted = events[3].obj
    assert deleted is not None and deleted.spec is not None and deleted.spec.podCIDRs == ["10.244.1.0/24"]


async def test_typed_requests_map_every_failure_to_one_error_tree() -> None:
    """The one mapping: an error status is KubeApiError (code, reason, message), no answer or an answer not of the
    kind's schema is KubeUnavailable naming the request; deleting what is gone is no error."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        name = request.url.path.rsplit("/", 1)[-1]
        if name == "gone":
            return httpx2.Response(404, json={"kind": "Status", "code": 404, "reason": "NotFound", "message": "no"})
        if name == "odd":
            return httpx2.Response(200, json={"kind": "Node", "metadata": {"name": 7}})
        if name == "away":
            raise httpx2.ConnectError("refused", request=request)
        return httpx2.Response(200, json={"kind": "Node", "metadata": {"name": name, "uid": "u1"}})

    src = resolve(None, env={"KUBECONFIG": str(_kubeconfig())})
    assert src is not None
    client = KubeClient(src, transport=httpx2.MockTransport(answer))
    try:
        got = await client.get(Node, "n1")
        assert isinstance(got, Node) and got.metadata is not None and got.metadata.uid == "u1"
        with pytest.raises(KubeApiError) as e:
            await client.get(Node, "gone")
        assert (e.value.code, e.value.reason, e.value.message) == (404, "NotFound", "no")
        with pytest.raises(KubeUnavailable, match="get Node odd: the answer is not of the kind's schema"):
            await client.get(Node, "odd")
        with pytest.raises(KubeUnavailable, match="get Node away: ConnectError"):
            await client.get(Node, "away")
        await client.delete(Node, "gone")  # gone already: what was asked
        with pytest.raises(KubeUnavailable):
            await client.delete(Node, "away")
    finally:
        await client.close()
