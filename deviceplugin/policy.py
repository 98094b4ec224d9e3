"""Allocation policy: GetPreferredAllocation's choice and Allocate's validation. Pure.

Preferred allocation, per container request:

1. every ``must_include`` ID is taken (each must be in ``available``);
2. the rest comes only from ``available``: IDs this resource knows and holds healthy first; only when those are too
   few, the others (kubelet's view may be a moment behind ours; Allocate then says exactly what is wrong);
3. devices on the fewest NUMA nodes: the NUMA nodes of ``must_include`` are always in, then the smallest set of further
   nodes with enough devices (ties: more devices, then lower node numbers); devices with no NUMA node fit anywhere;
4. replicas (``<id>::<k>``): ``spread`` takes the physical device with the fewest replicas taken so far (so pods land
   on distinct hardware); ``pack`` fills the physical device already in use first, then the one with the fewest free
   replicas (so whole devices stay free). Ties go by natural ID order, so the answer is deterministic.

:class:`PolicyError` carries ``kind`` ``invalid`` (INVALID_ARGUMENT) or ``precondition`` (FAILED_PRECONDITION); the
servicer maps it to a status code in one place.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from deviceplugin.discovery import natural_key
from deviceplugin.state import Listed, physical_id


class PolicyError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind  # "invalid" | "precondition"
        super().__init__(message)


@dataclass(frozen=True)
class Candidate:
    id: str
    numa: int | None
    physical: str


def _names(ids: Iterable[str]) -> str:
    return ", ".join(sorted(set(ids), key=natural_key))


def preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    lookup: Callable[[str], Listed | None],
    mode: str = "spread",
) -> list[str]:
    """The IDs to allocate for one container request (see the module docstring)."""
    if size <= 0:
        raise PolicyError("invalid", f"allocation_size must be positive, got {size}")
    dup = [i for i, n in Counter(must_include).items() if n > 1]
    if dup:
        raise PolicyError("invalid", f"duplicate IDs in must_include_deviceIDs: {_names(dup)}")
    avail_set = set(available)
    outside = [i for i in must_include if i not in avail_set]
    if outside:
        raise PolicyError("invalid", f"must_include_deviceIDs not in available_deviceIDs: {_names(outside)}")
    if len(must_include) > size:
        raise PolicyError(
            "invalid", f"must_include_deviceIDs has {len(must_include)} IDs, more than allocation_size {size}"
        )

    def cand(i: str) -> Candidate:
        e = lookup(i)
        return Candidate(i, e.device.numa if e else None, physical_id(i))

    chosen = [cand(i) for i in must_include]
    taken = set(must_include)
    pool = []
    for i in dict.fromkeys(available):
        if i in taken:
            continue
        e = lookup(i)
        if e is not None and e.healthy:
            pool.append(cand(i))
    need = size - len(chosen)
    if need > len(pool):
        rest = sorted((i for i in set(available) - taken if i not in {c.id for c in pool}), key=natural_key)
        if need > len(pool) + len(rest):
            raise PolicyError(
                "invalid", f"allocation_size {size} is more than the {len(set(available))} available_deviceIDs"
            )
        return [c.id for c in chosen] + [c.id for c in pool] + rest[: need - len(pool)]
    if need == 0:
        return [c.id for c in chosen]

    pool = _numa_subset(pool, chosen, need)
    per_physical = Counter(c.physical for c in chosen)
    free = Counter(c.physical for c in pool)
    pool.sort(key=lambda c: natural_key(c.id))
    while len(chosen) < size:
        if mode == "pack":
            best = min(pool, key=lambda c: (-per_physical[c.physical], free[c.physical], natural_key(c.id)))
        else:
            best = min(pool, key=lambda c: (per_physical[c.physical], -free[c.physical], natural_key(c.id)))
        pool.remove(best)
        chosen.append(best)
        per_physical[best.physical] += 1
        free[best.physical] -= 1
    return [c.id for c in chosen]


def _numa_subset(pool: list[Candidate], chosen: list[Candidate], need: int) -> list[Candidate]:
    """The pool restricted to the fewest NUMA nodes (beyond those ``chosen`` already uses) that hold ``need``."""
    fixed = {c.numa for c in chosen if c.numa is not None}
    per_node = Counter(c.numa for c in pool if c.numa is not None)
    anywhere = sum(1 for c in pool if c.numa is None)
    inside = anywhere + sum(per_node[n] for n in fixed)
    if inside >= need:
        return [c for c in pool if c.numa is None or c.numa in fixed]
    others = sorted(n for n in per_node if n not in fixed)
    for k in range(1, len(others) + 1):
        best: tuple[int, ...] | None = None
        best_count = -1
        for combo in itertools.combinations(others, k):
            count = inside + sum(per_node[n] for n in combo)
            if count >= need and count > best_count:
                best, best_count = combo, count
        if best is not None:
            keep = fixed | set(best)
            return [c for c in pool if c.numa is None or c.numa in keep]
    return pool


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
