"""GetPreferredAllocation's choice (NUMA, must_include, spread/pack) and Allocate's validation."""

from __future__ import annotations

import pytest

from deviceplugin.discovery import Device, DeviceNode
from deviceplugin.policy import PolicyError, check_allocation, preferred
from deviceplugin.state import DeviceTable


def table(numa: dict[str, int | None], replicas: int = 1, missing: tuple[str, ...] = ()) -> DeviceTable:
    t = DeviceTable(replicas=replicas)
    devs = [
        Device(i, (DeviceNode(f"/dev/{i}", f"/dev/{i}"),), n, "", missing if i == "sick" else ())
        for i, n in numa.items()
    ]
    t.update(devs, now=0)
    return t


def test_fewest_numa_nodes() -> None:
    t = table({"a0": 0, "a1": 1, "b0": 0, "b1": 1, "c1": 1, "d2": 2})
    ids = [e.id for e in t.listing]
    # three fit on node 1 alone
    assert sorted(preferred(ids, [], 3, t.get)) == ["a1", "b1", "c1"]
    # two fit on node 0 or 1 or ...: the node with more devices wins the tie (node 1), then low IDs
    assert sorted(preferred(ids, [], 2, t.get)) == ["a1", "b1"]
    # must_include pins node 0: stay there
    assert sorted(preferred(ids, ["a0"], 2, t.get)) == ["a0", "b0"]
    # four need two nodes: 1 (three) + the node of fewest extra... 0 has two, 2 has one: both fit, prefer more
    got = preferred(ids, [], 4, t.get)
    assert len(got) == 4 and {x[-1] for x in got} == {"0", "1"}


def test_only_available_and_healthy_are_chosen() -> None:
    t = table({"a": 0, "b": 0, "c": 0, "sick": 0}, missing=("/dev/x",))
    assert preferred(["c", "sick", "unknown"], [], 1, t.get) == ["c"]
    # too few healthy ones: the rest of available fills up (Allocate will name the bad ones)
    assert preferred(["unknown", "c", "sick"], [], 2, t.get) == ["c", "sick"]
    with pytest.raises(PolicyError, match="allocation_size 3 is more than the 2 available_deviceIDs") as e:
        preferred(["c", "sick"], [], 3, t.get)
    assert e.value.kind == "invalid"


def test_no_numa_fits_anywhere() -> None:
    t = table({"x": None, "a1": 1, "b1": 1, "c0": 0})
    assert sorted(preferred(["x", "a1", "b1", "c0"], ["c0"], 2, t.get)) == ["c0", "x"]


def test_replicas_spread_across_physical_devices_or_pack() -> None:
    t = table({"g0": 0, "g1": 0, "g2": 0}, replicas=3)
    ids = [e.id for e in t.listing]
    assert preferred(ids, [], 3, t.get, "spread") == ["g0::0", "g1::0", "g2::0"]
    assert preferred(ids, [], 4, t.get, "pack") == ["g0::0", "g0::1", "g0::2", "g1::0"]
    # pack fills the device already in use first
    assert preferred(ids, ["g2::1"], 2, t.get, "pack") == ["g2::1", "g2::0"]
    # spread avoids the device of must_include
    assert preferred(ids, ["g2::1"], 2, t.get, "spread") == ["g2::1", "g0::0"]
    # pack prefers the device with the fewest free replicas (keeps whole devices free)
    avail = ["g0::0", "g1::0", "g1::1", "g1::2"]
    assert preferred(avail, [], 1, t.get, "pack") == ["g0::0"]


@pytest.mark.parametrize(
    ("avail", "must", "size", "message"),
    [
        (["a"], [], 0, "allocation_size must be positive"),
        (["a"], ["b"], 1, "must_include_deviceIDs not in available_deviceIDs: b"),
        (["a", "b"], ["a", "b"], 1, "more than allocation_size 1"),
        (["a"], ["a", "a"], 2, "duplicate IDs in must_include_deviceIDs: a"),
    ],
)
def test_bad_preferred_requests(avail: list[str], must: list[str], size: int, message: str) -> None:
    t = table({"a": 0, "b": 0})
    with pytest.raises(PolicyError, match=message) as e:
        preferred(avail, must, size, t.get)
    assert e.value.kind == "invalid"


def test_check_allocation_names_every_bad_id() -> None:
    t = table({"a": 0, "b": 0, "sick": 0}, missing=("/dev/gone",))
    assert [e.id for e in check_allocation(["b", "a"], t.get)] == ["b", "a"]
    with pytest.raises(PolicyError, match=r"unknown device IDs: x, y") as e:
        check_allocation(["a", "y", "x"], t.get)
    assert e.value.kind == "invalid"
    with pytest.raises(PolicyError, match=r"duplicate device IDs: a") as e:
        check_allocation(["a", "b", "a"], t.get)
    assert e.value.kind == "invalid"
    with pytest.raises(PolicyError, match=r"unhealthy device IDs: sick \(device node missing: /dev/gone\)") as e:
        check_allocation(["a", "sick"], t.get)
    assert e.value.kind == "precondition"
    with pytest.raises(PolicyError, match="no device IDs"):
        check_allocation([], t.get)
