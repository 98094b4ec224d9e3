"""GetPreferredAllocation's choice (NUMA, must_include, spread/pack) and Allocate's validation.

The fast policy is checked against its definition (one pick at a time, every candidate re-scored) on generated
tables and requests, and its work is counted as the request grows.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.discovery import Device, DeviceNode, natural_key
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
    assert sorted(preferred(ids, [], 3, t.snapshot)) == ["a1", "b1", "c1"]
    # two fit on node 0 or 1 or ...: the node with more devices wins the tie (node 1), then low IDs
    assert sorted(preferred(ids, [], 2, t.snapshot)) == ["a1", "b1"]
    # must_include pins node 0: stay there
    assert sorted(preferred(ids, ["a0"], 2, t.snapshot)) == ["a0", "b0"]
    # four need two nodes: 1 (three) + the node of fewest extra... 0 has two, 2 has one: both fit, prefer more
    got = preferred(ids, [], 4, t.snapshot)
    assert len(got) == 4 and {x[-1] for x in got} == {"0", "1"}


def test_only_available_and_healthy_are_chosen() -> None:
    t = table({"a": 0, "b": 0, "c": 0, "sick": 0}, missing=("/dev/x",))
    assert preferred(["c", "sick", "unknown"], [], 1, t.snapshot) == ["c"]
    # too few healthy ones: the rest of available fills up (Allocate will name the bad ones)
    assert preferred(["unknown", "c", "sick"], [], 2, t.snapshot) == ["c", "sick"]
    with pytest.raises(PolicyError, match="allocation_size 3 is more than the 2 available_deviceIDs") as e:
        preferred(["c", "sick"], [], 3, t.snapshot)
    assert e.value.kind == "invalid"


def test_no_numa_fits_anywhere() -> None:
    t = table({"x": None, "a1": 1, "b1": 1, "c0": 0})
    assert sorted(preferred(["x", "a1", "b1", "c0"], ["c0"], 2, t.snapshot)) == ["c0", "x"]


def test_replicas_spread_across_physical_devices_or_pack() -> None:
    t = table({"g0": 0, "g1": 0, "g2": 0}, replicas=3)
    ids = [e.id for e in t.listing]
    assert preferred(ids, [], 3, t.snapshot, "spread") == ["g0::0", "g1::0", "g2::0"]
    assert preferred(ids, [], 4, t.snapshot, "pack") == ["g0::0", "g0::1", "g0::2", "g1::0"]
    # pack fills the device already in use first
    assert preferred(ids, ["g2::1"], 2, t.snapshot, "pack") == ["g2::1", "g2::0"]
    # spread avoids the device of must_include
    assert preferred(ids, ["g2::1"], 2, t.snapshot, "spread") == ["g2::1", "g0::0"]
    # pack prefers the device with the fewest free replicas (keeps whole devices free)
    avail = ["g0::0", "g1::0", "g1::1", "g1::2"]
    assert preferred(avail, [], 1, t.snapshot, "pack") == ["g0::0"]


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
        preferred(avail, must, size, t.snapshot)
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


# ---------------------------------------------------------------- the fast policy against its definition


def one_at_a_time(available: list[str], must: list[str], size: int, t: DeviceTable, mode: str) -> list[str]:
    """The policy as the module docstring states it, the slow and obvious way (a valid request)."""
    snap = t.snapshot
    known = {i: e for i in dict.fromkeys(available) if (e := snap.get(i)) is not None}
    chosen, taken = list(must), set(must)
    pool = [i for i in dict.fromkeys(available) if i not in taken and i in known and known[i].healthy]
    need = size - len(must)
    if need > len(pool):
        rest = sorted((i for i in dict.fromkeys(available) if i not in taken and i not in pool), key=natural_key)
        return chosen + pool + rest[: need - len(pool)]
    if need == 0:
        return chosen
    fixed = {known[i].device.numa for i in must if i in known} - {None}
    nodes = sorted({known[i].device.numa for i in pool} - {None} - fixed)

    def within(keep: set[int | None]) -> list[str]:
        return [i for i in pool if known[i].device.numa in keep]

    for k in range(len(nodes) + 1):  # the fewest further nodes; then the most devices; then the lowest numbers
        best = max((within({None, *fixed, *c}) for c in itertools.combinations(nodes, k)), key=len)
        if len(best) >= need:
            pool = best
            break
    per = Counter(known[i].device.id for i in must if i in known)
    free = Counter(known[i].device.id for i in pool)
    while len(chosen) < size:
        sign = -1 if mode == "pack" else 1
        best = min(pool, key=lambda i: (sign * per[known[i].device.id], -sign * free[known[i].device.id], snap.rank[i]))
        pool.remove(best)
        chosen.append(best)
        per[known[best].device.id] += 1
        free[known[best].device.id] -= 1
    return chosen


@st.composite
def requests(draw: st.DrawFn) -> tuple[DeviceTable, list[str], list[str], int, str]:
    replicas = draw(st.integers(1, 3))
    numa = draw(st.lists(st.sampled_from([None, 0, 1, 2]), min_size=1, max_size=10))
    sick = draw(st.sets(st.integers(0, len(numa) - 1)))
    t = DeviceTable(replicas=replicas)
    t.update(
        [
            Device(f"d{k}", (DeviceNode(f"/dev/d{k}", f"/dev/d{k}"),), n, "", ("/dev/gone",) if k in sick else ())
            for k, n in enumerate(numa)
        ],
        now=0,
    )
    ids = [e.id for e in t.listing] + ["x1", "x2::0"]  # two IDs kubelet has and we do not
    available = draw(st.lists(st.sampled_from(ids), min_size=1, max_size=40))  # repeats are kubelet's business
    unique = list(dict.fromkeys(available))
    must = draw(st.lists(st.sampled_from(unique), unique=True, max_size=len(unique)))
    size = draw(st.integers(max(1, len(must)), len(unique) + 1))
    return t, available, must, size, draw(st.sampled_from(["spread", "pack"]))


@settings(max_examples=400, deadline=None)
@given(requests())
def test_the_fast_policy_answers_as_one_pick_at_a_time(req: tuple[DeviceTable, list[str], list[str], int, str]) -> None:
    t, available, must, size, mode = req
    if size > len(set(available)):
        with pytest.raises(PolicyError, match="is more than the"):
            preferred(available, must, size, t.snapshot, mode)
        return
    got = preferred(available, must, size, t.snapshot, mode)
    assert got == one_at_a_time(available, must, size, t, mode)
    assert len(got) == len(set(got)) == size and got[: len(must)] == must and set(got) <= set(available)


def _calls(fn: Callable[[], object]) -> int:
    """Python-level function calls, and calls from Python code into C, while ``fn`` runs: an operation count that
    grows with the work done, whatever the machine's speed."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_preference_work_grows_like_n_log_n_not_n_squared() -> None:
    """Regression: the choice was made by re-scoring every candidate for every pick, so 10,000 available IDs and a
    size of 300 took 14 s. Doubling the request may now cost about twice the operations, not four times."""

    def work(n: int) -> int:
        t = table({f"0000:{k // 256:02x}:{k % 256:02x}.0": k % 2 for k in range(n // 2)}, replicas=2)
        ids = [e.id for e in t.listing][::-1]
        return max(_calls(lambda m=mode: preferred(ids, ids[:2], n // 4, t.snapshot, m)) for mode in ("spread", "pack"))

    small, large = work(1000), work(2000)
    assert large < 3 * small, f"{small} operations for 1,000 IDs, {large} for 2,000"
