"""The snapshot importer's decisions, on VolumeSnapshotContents as the API server may send them (any shape, any
values: a content is written by whoever may create one): what it adopts, what it leaves, and which one agent speaks
when nobody holds a snapshot."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.storage_v1 import CSINodeDriver, CSINodeSpec
from lightkube.resources.storage_v1 import CSINode

from csi.snapshotimport import MANAGED_BY, Content, VolumeSnapshotContent, decide, driver_nodes, reporter
from nodeplug.kube.client import decode

DRIVER = "local.csi.nodeplug.io"
SID = "snap-" + "a" * 32


def raw(name: str = "c1", driver: str = DRIVER, handle: str | None = SID, labels: dict[str, str] | None = None) -> Any:
    source = {"snapshotHandle": handle} if handle is not None else {"volumeHandle": "vol-x"}
    return {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
            "metadata": {"name": name, "uid": "u1", "resourceVersion": "7", **({"labels": labels} if labels else {})},
            "spec": {"driver": driver, "deletionPolicy": "Delete", "source": source,
                     "volumeSnapshotRef": {"namespace": "ns", "name": "snap", "uid": "s1"}}}  # fmt: skip


def content(**kw: Any) -> Content:
    c = Content.of(decode(raw(**kw), VolumeSnapshotContent))
    assert c is not None
    return c


def test_a_hand_made_content_of_this_driver_naming_a_held_snapshot_is_adopted() -> None:
    c = content()
    assert (c.name, c.snapshot_handle, c.managed_by, c.resource_version) == ("c1", SID, "", "7")
    assert c.snapshot is not None and (c.snapshot.kind, c.snapshot.namespace, c.snapshot.name) == (
        "VolumeSnapshot",
        "ns",
        "snap",
    )
    assert decide(c, driver=DRIVER, holds=True) == "adopt"
    assert decide(c, driver=DRIVER, holds=False) == "unclaimed"


def test_what_is_left_alone() -> None:
    assert decide(content(labels={MANAGED_BY: "node-b"}), driver=DRIVER, holds=True) == "leave"  # someone's already
    assert decide(content(driver="hostpath.csi.k8s.io"), driver=DRIVER, holds=True) == "leave"
    assert decide(content(handle=None), driver=DRIVER, holds=True) == "leave"  # made for a new snapshot
    assert decide(content(labels={"other": "x"}), driver=DRIVER, holds=True) == "adopt"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=10,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.fixed_dictionaries(
            {},
            optional={
                "name": json_values | st.text(max_size=20),
                "labels": json_values,
                "resourceVersion": json_values,
            },
        )
        | json_values,
        "spec": st.fixed_dictionaries(
            {},
            optional={
                "driver": st.sampled_from([DRIVER, "x"]) | json_values,
                "source": st.fixed_dictionaries({}, optional={"snapshotHandle": json_values}) | json_values,
                "volumeSnapshotRef": json_values,
            },
        )
        | json_values,
    },
)


@given(fields)
def test_any_object_is_refused_at_the_edge_or_decided_safely(obj: dict[str, Any]) -> None:
    try:
        model = decode(obj, VolumeSnapshotContent)
    except msgspec.ValidationError:
        return  # the watch takes an object of the wrong shape as absent
    c = Content.of(model)
    if c is None:
        return
    held = decide(c, driver=DRIVER, holds=True)
    if held == "adopt":  # only ever an unlabelled content of this driver that names a snapshot
        assert c.driver == DRIVER and c.snapshot_handle and not c.managed_by
    assert decide(c, driver=DRIVER, holds=False) != "adopt"


nodes = st.sets(st.text(alphabet="abcdefgh-0123", min_size=1, max_size=12), min_size=1, max_size=30)


@given(st.text(max_size=40), nodes)
def test_one_reporter_whatever_the_order_and_stable_when_another_node_goes(name: str, names: set[str]) -> None:
    chosen = reporter(name, names)
    assert chosen in names
    assert reporter(name, sorted(names, reverse=True)) == chosen
    for gone in names - {chosen}:
        assert reporter(name, names - {gone}) == chosen  # only the contents a leaving node spoke for move
    assert reporter(name, ()) == ""


def test_the_reporters_spread_over_the_nodes() -> None:
    names = {f"node-{i}" for i in range(4)}
    picked = {reporter(f"content-{i}", names) for i in range(200)}
    assert picked == names


def test_driver_nodes_are_those_whose_csinode_lists_the_driver() -> None:
    def csinode(name: str, *drivers: str) -> CSINode:
        return CSINode(metadata=ObjectMeta(name=name),
                       spec=CSINodeSpec(drivers=[CSINodeDriver(name=d, nodeID=name) for d in drivers]))  # fmt: skip

    got = driver_nodes([csinode("a", DRIVER), csinode("b", "other"), csinode("c", "other", DRIVER), csinode("d")],
                       DRIVER)  # fmt: skip
    assert got == {"a", "c"}
