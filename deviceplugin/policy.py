"""Allocation policy: GetPreferredAllocation's choice and Allocate's validation. Pure.

Preferred allocation, per container request:

1. every ``must_include`` ID is taken (each must be in ``available``);
2. the rest comes only from ``available``: IDs this resource knows and holds healthy first; only when those are too
   few, the others (kubelet's view may be a moment behind ours; Allocate then says exactly what is wrong);
3. devices on the fewest NUMA nodes: the NUMA nodes of ``must_include`` are always in, then the smallest set of further
   nodes with enough devices (ties: more devices, then lower node numbers); devices with no NUMA node fit anywhere;
4. replicas (``<id>::<k>``): ``spread`` takes the physical device with the fewest replicas taken so far (so pods land
   on distinct hardware); ``pack`` fills the physical device already in use first, then the one with the fewest free
   replicas (so whole devices stay free). Ties go by the listing's order (natural order of the devices, then replica
   number), so the answer is deterministic.

It reads one :class:`~deviceplugin.state.Snapshot` of the table, so the servicer runs it off the event loop.

:class:`PolicyError` carries ``kind`` ``invalid`` (INVALID_ARGUMENT) or ``precondition`` (FAILED_PRECONDITION); the
servicer maps it to a status code in one place.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from deviceplugin.discovery import natural_key
from deviceplugin.state import Listed, Snapshot


class PolicyError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind  # "invalid" | "precondition"
        super().__init__(message)


def _names(ids: Iterable[str]) -> str:
    return ", ".join(sorted(set(ids), key=natural_key))


def preferred(
    available: Sequence[str], must_include: Sequence[str], size: int, snap: Snapshot, mode: str = "spread"
) -> list[str]:
    """The IDs to allocate for one container request (see the module docstring).

    O(n log n) in the number of IDs: every ID is looked up once, and the candidates are ordered by their rank in the
    listing (integers, not ID strings).
    """
    if size <= 0:
        raise PolicyError("invalid", f"allocation_size must be positive, got {size}")
    dup = [i for i, n in Counter(must_include).items() if n > 1]
    if dup:
        raise PolicyError("invalid", f"duplicate IDs in must_include_deviceIDs: {_names(dup)}")
    avail = dict.fromkeys(available)  # each ID once, in kubelet's order
    outside = [i for i in must_include if i not in avail]
    if outside:
        raise PolicyError("invalid", f"must_include_deviceIDs not in available_deviceIDs: {_names(outside)}")
    if len(must_include) > size:
        raise PolicyError(
            "invalid", f"must_include_deviceIDs has {len(must_include)} IDs, more than allocation_size {size}"
        )

    listing, healthy = snap.listing, snap.healthy_rank
    taken = set(must_include)
    # ranks of the available IDs we hold healthy, in kubelet's order (map and filter run in C: this is the loop
    # over every ID)
    if taken:
        held = {healthy[i] for i in taken if i in healthy}
        pool = [r for r in map(healthy.get, avail) if r is not None and r not in held]
    else:
        pool = [r for r in map(healthy.get, avail) if r is not None]
    need = size - len(must_include)
    if need > len(pool):
        others = [i for i in avail if i not in taken and i not in healthy]  # unknown to us, or unhealthy
        if need > len(pool) + len(others):
            raise PolicyError("invalid", f"allocation_size {size} is more than the {len(avail)} available_deviceIDs")
        others.sort(key=natural_key)
        return [*must_include, *(listing[r].id for r in pool), *others[: need - len(pool)]]
    if need == 0:
        return list(must_include)

    fixed = [snap.get(i) for i in must_include]
    numas = {e.device.numa for e in fixed if e is not None and e.device.numa is not None}
    pool = _fewest_numa_nodes(pool, snap.numa, numas, need)
    pool.sort()
    if snap.replicas == 1:  # one ID per device: every candidate stands equal, listing order decides
        picked = pool[:need]
    else:
        taken_devices = Counter(snap.rank[i] // snap.replicas for i in must_include if i in snap.rank)
        picked = _replicas(pool, snap.replicas, taken_devices, need, mode)
    return [*must_include, *(listing[r].id for r in picked)]


def _fewest_numa_nodes(pool: list[int], numa: Sequence[int | None], fixed: set[int], need: int) -> list[int]:
    """The pool restricted to the fewest NUMA nodes (beyond ``fixed``, those of must_include) that hold ``need``.

    The best set of k further nodes is the k nodes with the most devices (ties: lower node numbers), so the nodes are
    taken in that order until enough devices are in; devices with no NUMA node fit anywhere.
    """
    per_node = Counter(map(numa.__getitem__, pool))
    count = per_node.pop(None, 0) + sum(per_node[n] for n in fixed)
    keep: set[int | None] = {None, *fixed}
    for n in sorted((n for n in per_node if n not in fixed), key=lambda n: (-per_node[n], n)):
        if count >= need:
            break
        keep.add(n)
        count += per_node[n]
    if keep >= per_node.keys():
        return pool
    return [r for r in pool if numa[r] in keep]


def _replicas(pool: list[int], replicas: int, taken: Counter[int], need: int, mode: str) -> list[int]:
    """``need`` of the sorted pool's ranks, one at a time: ``spread`` takes from the physical device with the fewest
    replicas taken so far (then the most free ones), ``pack`` from the one with the most taken (then the fewest free);
    ties, and the replica within a device, go by listing order.

    That one-at-a-time choice has a closed form, which is what runs here (O(n log n), no rescoring per pick). A device
    ``d`` with ``t`` replicas taken by must_include and ``f`` free ones in the pool stands at (t + k, k - f, its next
    rank) for spread after k picks from it, so the picks come in "levels" L = t + k, and within a level in the order
    of (-(t + f), d), the same at every level. For pack it stands at (-(t + k), f - k, next rank): it only gets better
    when picked, so the device first in the order (-t, f, d) is drained before the next one starts.
    """
    free = Counter(map(replicas.__rfloordiv__, pool))  # device number (rank // replicas) -> free replicas, ascending
    devices, counts = list(free), list(free.values())
    starts = list(itertools.accumulate(counts, initial=0))  # device j's free ranks are pool[starts[j]:starts[j + 1]]
    held = [taken[d] for d in devices]
    out: list[int] = []
    if mode == "pack":
        for j in sorted(range(len(devices)), key=lambda j: (-held[j], counts[j], j)):
            out += pool[starts[j] : starts[j + 1]][: need - len(out)]
            if len(out) == need:
                break
        return out
    order = sorted(range(len(devices)), key=lambda j: (-(held[j] + counts[j]), j))
    level = min(held)
    while len(out) < need:  # at most max(t + f) <= 2 * replicas levels; each visits the devices once
        for j in order:
            k = level - held[j]
            if 0 <= k < counts[j]:
                out.append(pool[starts[j] + k])
                if len(out) == need:
                    break
        level += 1
    return out


def check_allocation(ids: Sequence[str], lookup: Callable[[str], Listed | None]) -> list[Listed]:
    """The listed devices for one container's IDs; raise naming every unknown, duplicate or unhealthy ID."""
    if not ids:
        raise PolicyError("invalid", "no device IDs in the container request")
    dup = [i for i, n in Counter(ids).items() if n > 1]
    if dup:
        raise PolicyError("invalid", f"duplicate device IDs: {_names(dup)}")
    entries = [(i, lookup(i)) for i in ids]
    unknown = [i for i, e in entries if e is None]
    if unknown:
        raise PolicyError("invalid", f"unknown device IDs: {_names(unknown)}")
    sick = [f"{i} ({e.reason})" for i, e in entries if e is not None and not e.healthy]
    if sick:
        raise PolicyError("precondition", "unhealthy device IDs: " + ", ".join(sick))
    return [e for _, e in entries if e is not None]
