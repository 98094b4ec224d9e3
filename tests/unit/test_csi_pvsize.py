"""The size a PersistentVolume gives a volume (csi.pvsize.capacity_of), read at NodeStageVolume: only this driver's
PV for this volume counts, and its quantity, which comes from the API server, is read defensively (any text)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lightkube.resources.core_v1 import PersistentVolume

from csi.pvsize import MAX_BYTES, capacity_of

DRIVER = "local.csi.nodeplug.io"
VID = "vol-0123456789abcdef0123456789abcdef"


def pv(storage: Any = "192Mi", driver: str = DRIVER, handle: str = VID) -> PersistentVolume:
    return PersistentVolume.from_dict({
        "metadata": {"name": "pvc-1"},
        "spec": {"capacity": {"storage": storage}, "csi": {"driver": driver, "volumeHandle": handle}},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("storage", "size"),
    [("192Mi", 192 << 20), ("1Gi", 1 << 30), ("1.5Gi", 3 << 29), ("64M", 64 * 10**6), ("1000", 1000), ("1e3", 1000)],
)
def test_the_size_a_pv_gives_its_volume(storage: str, size: int) -> None:
    assert capacity_of(pv(storage), DRIVER, VID) == size


@pytest.mark.parametrize(
    "other",
    [
        pv(driver="other.csi.example.com"),
        pv(handle="vol-ffffffffffffffffffffffffffffffff"),
        pv(storage="0"),
        pv(storage="-1Gi"),
        pv(storage="lots"),
        pv(storage="2Ei"),  # beyond any volume here
        PersistentVolume.from_dict({"metadata": {"name": "pvc-1"}, "spec": {"capacity": {"storage": "1Gi"}}}),
    ],
)
def test_anything_else_gives_no_size(other: PersistentVolume) -> None:
    assert capacity_of(other, DRIVER, VID) is None


@given(st.text(max_size=40))
def test_any_quantity_text(text: str) -> None:
    got = capacity_of(pv(text), DRIVER, VID)
    assert got is None or (isinstance(got, int) and 0 < got <= MAX_BYTES)
